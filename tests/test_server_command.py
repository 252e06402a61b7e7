"""`mergeflow server` stops with its Prefect server on SIGTERM, SIGINT and SIGHUP, and a record of a server that is gone
is never used."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from mergeflow.deployments.server import STATE_FILE, healthy, kept_up_api_url
from tests.test_serve import free_port, wait_until

STARTUP_SECONDS = 180
STOP_SECONDS = 15


@pytest.fixture
def prefect_home(tmp_path, monkeypatch):
    home = tmp_path / "prefect-home"
    monkeypatch.setenv("PREFECT_HOME", str(home))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    return home


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=["TERM", "INT", "HUP"])
def test_a_signal_stops_the_server_command_and_its_prefect_server(prefect_home, signum):
    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    server = subprocess.Popen(
        [sys.executable, "-m", "mergeflow", "server", "--port", str(port)],
        env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    state_file = prefect_home / "mergeflow" / STATE_FILE
    try:
        wait_until(lambda: state_file.is_file() and healthy(api_url), STARTUP_SECONDS, "the server to answer")

        server.send_signal(signum)

        assert server.wait(timeout=STOP_SECONDS) == 0
    finally:
        server.kill()
    assert not healthy(api_url), "its Prefect server still answers"
    assert not state_file.exists()
    assert "mergeflow: the Prefect server is stopped" in server.stdout.read()


def stale_state(prefect_home, pid: int, api_url: str):
    state_file = prefect_home / "mergeflow" / STATE_FILE
    state_file.parent.mkdir(parents=True)
    state_file.write_text(json.dumps({"api_url": api_url, "pid": pid}))
    return state_file


def test_a_server_record_whose_process_is_gone_is_ignored_and_removed(prefect_home):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    state_file = stale_state(prefect_home, gone.pid, f"http://127.0.0.1:{free_port()}/api")

    assert kept_up_api_url() is None
    assert not state_file.exists()


def test_a_server_record_whose_server_does_not_answer_is_ignored_and_removed(prefect_home):
    state_file = stale_state(prefect_home, os.getpid(), f"http://127.0.0.1:{free_port()}/api")

    started = time.monotonic()
    assert kept_up_api_url() is None
    assert time.monotonic() - started < 5
    assert not state_file.exists()
