"""The Prefect server a command talks to: the one PREFECT_API_URL (or the active Prefect profile) names, the
one `mergeflow server` keeps up, or else a temporary one this command starts at once, so that it comes up
while the command imports its libraries and starts merging, instead of after. Imports no Prefect."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from mergeflow.perf import timeline

API_URL_VARIABLE = "PREFECT_API_URL"
HEALTH_TIMEOUT_SECONDS = 2.0
STARTUP_TIMEOUT_SECONDS = 180.0
STATE_FILE = "server.json"
"""Under PREFECT_HOME/mergeflow/: where `mergeflow server` says which server it keeps up."""
DEFAULT_PORT = 4200
SERVER_STOP_SECONDS = 10.0


def prefect_home() -> Path:
    return Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect").expanduser()


def state_file() -> Path:
    return prefect_home() / "mergeflow" / STATE_FILE


def configured_api_url() -> str | None:
    """The API URL Prefect itself would use: PREFECT_API_URL, else the active profile's setting."""
    if os.environ.get(API_URL_VARIABLE):
        return os.environ[API_URL_VARIABLE]
    path = Path(os.environ.get("PREFECT_PROFILES_PATH") or prefect_home() / "profiles.toml")
    try:
        profiles = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return None
    active = os.environ.get("PREFECT_PROFILE") or profiles.get("active", "ephemeral")
    return profiles.get("profiles", {}).get(active, {}).get(API_URL_VARIABLE) or None


def kept_up_api_url() -> str | None:
    """The API URL of a `mergeflow server` running for this PREFECT_HOME, if it answers. A state file whose server
    process is gone or does not answer is stale: it is removed."""
    state_path = state_file()
    try:
        state = json.loads(state_path.read_text())
    except (OSError, ValueError):
        return None
    api_url = state.get("api_url") if isinstance(state, dict) else None
    if api_url and _alive(state.get("pid")) and healthy(api_url):
        return api_url
    state_path.unlink(missing_ok=True)
    return None


def _alive(pid) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def healthy(api_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=HEALTH_TIMEOUT_SECONDS) as response:
            return response.status == 200
    except OSError:
        return False


class TemporaryServer:
    """A Prefect API server for this command only (no UI, no scheduler): the command Prefect's own
    temporary server runs, started at once; `wait` blocks until it answers, `stop` ends it."""

    def __init__(self):
        self.port = _free_port()
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mergeflow.deployments.temporary_api", str(self.port)],
            env={**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"},
            stdin=subprocess.DEVNULL,
        )
        timeline.mark("temporary server started")

    def answers(self) -> bool:
        return healthy(self.api_url)

    def wait(self, timeout: float = STARTUP_TIMEOUT_SECONDS) -> None:
        """Block until the server answers.

        Raises:
            RuntimeError: it exited or did not answer within `timeout` seconds.
        """
        deadline = time.monotonic() + timeout
        while not self.answers():
            if self.process.poll() is not None:
                raise RuntimeError(f"the temporary Prefect server exited with code {self.process.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the temporary Prefect server did not answer within {timeout:.0f} s")
            time.sleep(0.05)
        timeline.mark("temporary server answered")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@contextlib.contextmanager
def prefect_api() -> Iterator[TemporaryServer | None]:
    """Point this process (and its children) at a Prefect server for the block: the configured one, else the
    one `mergeflow server` keeps up, else a temporary one started now and stopped at the end (yielded, so
    the caller can `wait` for it as late as possible)."""
    if configured_api_url():
        yield None
        return
    api_url = kept_up_api_url()
    server = None if api_url else TemporaryServer()
    os.environ[API_URL_VARIABLE] = api_url or server.api_url
    try:
        yield server
    finally:
        os.environ.pop(API_URL_VARIABLE, None)
        if server is not None:
            server.stop()


def keep_server_up(port: int = DEFAULT_PORT) -> int:
    """`mergeflow server`: run a Prefect server with its UI on 127.0.0.1 until SIGTERM, SIGINT or SIGHUP (which stop
    the server too), and, once it answers, tell the other mergeflow commands of this PREFECT_HOME to use it.
    Returns the server's exit code (0 when stopped by a signal)."""
    api_url = f"http://127.0.0.1:{port}/api"
    state_path = state_file()
    environment = {**os.environ, "PREFECT_UI_API_URL": api_url, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    process = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=environment,
        start_new_session=True,  # its process group is stopped with it, by this process only
    )
    stopped_at: list[float] = []

    def stop(signum, frame) -> None:
        if not stopped_at:
            stopped_at.append(time.monotonic())
            _signal_group(process, signal.SIGTERM)

    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    announced = False
    try:
        while process.poll() is None:
            if not announced and not stopped_at and healthy(api_url):
                announced = True
                state_path.parent.mkdir(parents=True, exist_ok=True)
                state_path.write_text(json.dumps({"api_url": api_url, "pid": process.pid}))
                print(f"mergeflow: Prefect UI at http://127.0.0.1:{port}; mergeflow commands with PREFECT_HOME={prefect_home()} use it")
                print(f"mergeflow: for other Prefect tools: export {API_URL_VARIABLE}={api_url}")
                print(f"mergeflow: stop it with Ctrl-C or `kill {os.getpid()}`", flush=True)
            if stopped_at and time.monotonic() - stopped_at[0] > SERVER_STOP_SECONDS:
                _signal_group(process, signal.SIGKILL)
            time.sleep(0.2)
    finally:
        state_path.unlink(missing_ok=True)
        if process.poll() is None:
            _signal_group(process, signal.SIGKILL)
            process.wait()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if stopped_at:
        print("mergeflow: the Prefect server is stopped", flush=True)
        return 0
    return process.returncode


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    """Send `signum` to the server's process group (the server and whatever it started)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signum)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
