"""`mergeflow serve` against a Prefect server that goes away: one warning line instead of tracebacks, serving again
once the server is back, and a stop within seconds whether the server answers or not."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_serve import STARTUP_SECONDS, free_port, healthy, server_environment, wait_until

pytestmark = pytest.mark.slow

STOP_SECONDS = 5.0
OUTAGE_WARNING = "does not answer"


class Server:
    """`prefect server start` on one port and Prefect home, which can be stopped and started again."""

    def __init__(self, env: dict, port: int, log: Path):
        self.env, self.port, self.log = env, port, log
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["prefect", "server", "start", "--host", "127.0.0.1", "--port", str(self.port)],
            env=self.env, stdout=open(self.log, "a"), stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        wait_until(lambda: healthy(self.env["PREFECT_API_URL"]), STARTUP_SECONDS, "the Prefect server")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=30)


@pytest.fixture
def serving(tmp_path):
    """A Prefect server and `mergeflow serve` on an empty run directory: (server, serve process, its console log)."""
    port = free_port()
    env = server_environment(tmp_path, port)
    (tmp_path / "run").mkdir()
    server = Server(env, port, tmp_path / "server.log")
    server.start()
    log = tmp_path / "serve.log"
    serve = subprocess.Popen(
        [sys.executable, "-m", "mergeflow", "serve", "--watch", str(tmp_path / "run"), "--output", str(tmp_path / "out")],
        env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        wait_until(lambda: "mergeflow: watching" in log.read_text(), STARTUP_SECONDS, "serve to start")
        time.sleep(3)  # its runner and merge reports are polling by now
        yield server, serve, log
    finally:
        serve.kill()
        server.stop()


def stop_seconds(serve: subprocess.Popen, signum: int) -> float:
    started = time.monotonic()
    serve.send_signal(signum)
    serve.wait(timeout=60)
    return time.monotonic() - started


def test_a_server_that_goes_away_is_one_warning_line_and_serve_stops_within_seconds(serving):
    server, serve, log = serving

    server.stop()
    wait_until(lambda: OUTAGE_WARNING in log.read_text(), 30, "the warning")
    time.sleep(5)  # a few more polls and reconnection attempts

    assert log.read_text().count(OUTAGE_WARNING) == 1, log.read_text()
    assert "Traceback" not in log.read_text(), log.read_text()
    seconds = stop_seconds(serve, signal.SIGTERM)
    assert seconds < STOP_SECONDS, f"{seconds:.1f} s\n{log.read_text()}"


def test_serve_says_when_the_server_is_back_and_stops_within_seconds(serving):
    server, serve, log = serving
    server.stop()
    wait_until(lambda: OUTAGE_WARNING in log.read_text(), 30, "the warning")

    server.start()

    wait_until(lambda: "mergeflow: the Prefect server answers again" in log.read_text(), 30, "the server to be back")
    seconds = stop_seconds(serve, signal.SIGINT)
    assert seconds < STOP_SECONDS, f"{seconds:.1f} s\n{log.read_text()}"
