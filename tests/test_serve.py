"""End to end against a real `prefect server start`: `mergeflow serve --watch RUN --output OUT` turns each
checkpoint verl saves into a merged, validated model, once."""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, TaskRunFilter, TaskRunFilterName
from prefect.settings import PREFECT_API_URL, temporary_settings

from mergeflow.validation.validate import validate_model_dir
from tests.run_dirs import save_step
from tests.writers.hf_tree import hf_model_only

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("serve")]
"""One worker runs the module in order: its tests follow one served run directory through its checkpoints."""

STARTUP_SECONDS = 180
MERGE_SECONDS = 120
QUIET_SECONDS = 15
EARLIER_RUN, EARLIER_STEP = "run-b", 5
"""A run whose checkpoint was complete before `mergeflow serve` started."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(condition, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if result := condition():
            return result
        time.sleep(0.5)
    raise AssertionError(f"timed out after {seconds}s waiting for {what}")


def healthy(api_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def server_environment(base: Path, port: int) -> dict[str, str]:
    """The environment of processes that use a Prefect server on `port`, with a Prefect home and results under `base`."""
    api_url = f"http://127.0.0.1:{port}/api"
    return {
        **os.environ,
        "PREFECT_HOME": str(base / "prefect-home"),
        "PREFECT_API_URL": api_url,
        "PREFECT_UI_API_URL": api_url,
        "PREFECT_UI_ENABLED": "false",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(base / "results"),
        "PREFECT_RUNNER_POLL_FREQUENCY": "2",
        "PREFECT_LOGGING_LEVEL": "INFO",
    }


@pytest.fixture(scope="module")
def served(fixtures, tmp_path_factory):
    """A Prefect server, and `mergeflow serve` watching an empty run directory: (env, run_dir, output_dir, serve_log),
    where `env` points a process at that server and `serve_log` holds what serve printed."""
    base = tmp_path_factory.mktemp("serve")
    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    env = server_environment(base, port)
    logs = base / "logs"
    logs.mkdir()
    server = subprocess.Popen(
        ["prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env, stdout=open(logs / "server.log", "w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    run_dir, output_dir = base / "run-a", base / "out"
    run_dir.mkdir()
    save_step(fixtures["qwen2-ws2"], base / EARLIER_RUN, EARLIER_STEP)  # complete before serve starts
    try:
        wait_until(lambda: healthy(api_url), STARTUP_SECONDS, "the Prefect server")
        serve = subprocess.Popen(
            [sys.executable, "-m", "mergeflow", "serve", "--watch", str(run_dir), "--watch", str(base / EARLIER_RUN),
             "--output", str(output_dir)],
            env=env, stdout=open(logs / "serve.log", "w"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            with temporary_settings({PREFECT_API_URL: api_url}):
                wait_until(lambda: _deployment_count() == 2, STARTUP_SECONDS, "the served deployments")
                wait_until(lambda: len(watch_lines(logs / "serve.log")) == 2, STARTUP_SECONDS, "serve's line on each run")
                yield env, run_dir, output_dir, logs / "serve.log"
        finally:
            stop(serve)
    finally:
        stop(server)


def _deployment_count() -> int:
    with get_client(sync_client=True) as client:
        return len(client.read_deployments())


def flow_runs(label: str):
    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=label)))


def publish_states(label: str) -> list[str]:
    """States of the publish task runs of every flow run merging `label` (Cached on a cache hit)."""
    runs = flow_runs(label)
    if not runs:
        return []
    with get_client(sync_client=True) as client:
        task_runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id={"any_": [run.id for run in runs]}),
            task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_="publish")),
        )
    return sorted(run.state.name for run in task_runs if run.state and run.state.is_final())


def test_saved_checkpoint_becomes_a_validated_model(served, fixtures):
    _, run_dir, output_dir, _ = served

    save_step(fixtures["qwen2-ws2"], run_dir, 1)

    target = output_dir / "run-a" / "global_step_1" / "actor"
    wait_until(lambda: (target / "model.safetensors").is_file(), MERGE_SECONDS, "the merged model")
    (run,) = wait_until(
        lambda: [r for r in flow_runs("run-a/step-1/actor") if r.state.is_completed()] or None,
        MERGE_SECONDS,
        "a Completed flow run",
    )
    assert run.name == f"merge run-a/step-1/actor into {'/'.join(target.parts[-4:])}"
    assert validate_model_dir(target).passed


def test_a_checkpoint_complete_before_serve_started_is_merged_promptly(served):
    _, _, output_dir, _ = served

    target = output_dir / EARLIER_RUN / f"global_step_{EARLIER_STEP}" / "actor"
    wait_until(lambda: (target / "model.safetensors").is_file(), MERGE_SECONDS, "the merge of the earlier checkpoint")
    assert validate_model_dir(target).passed


def test_shards_without_a_tracker_update_trigger_nothing(served, fixtures):
    _, run_dir, output_dir, _ = served

    save_step(fixtures["qwen2-ws2"], run_dir, 2, update_tracker=False)

    time.sleep(QUIET_SECONDS)
    assert flow_runs("run-a/step-2/actor") == []
    assert not (output_dir / "run-a" / "global_step_2").exists()


def announce(env: dict, run_dir: Path, step: int, *version: str) -> None:
    """Emit a step's event from another process, as the watcher would."""
    command = [sys.executable, "-m", "tests.announce", str(run_dir), str(step), *version]
    subprocess.run(command, env=env, check=True, timeout=120)


def test_the_same_event_twice_merges_once(served):
    env, run_dir, _, _ = served
    wait_until(lambda: publish_states("run-a/step-1/actor") == ["Completed"], MERGE_SECONDS, "the first merge")

    announce(env, run_dir, 1)

    time.sleep(QUIET_SECONDS)
    assert publish_states("run-a/step-1/actor").count("Completed") == 1


def test_another_run_on_the_same_checkpoint_is_a_cache_hit(served):
    env, run_dir, _, _ = served

    announce(env, run_dir, 1, "a version the watcher never saw")

    wait_until(lambda: "Cached" in publish_states("run-a/step-1/actor"), MERGE_SECONDS, "a Cached merge")
    assert publish_states("run-a/step-1/actor").count("Completed") == 1


def console_lines(serve_log: Path) -> list[str]:
    """What serve said on its console (not Prefect's log records)."""
    return [line for line in serve_log.read_text().splitlines() if line.startswith("mergeflow: ")]


def watch_lines(serve_log: Path) -> list[str]:
    """Serve's line on each run it watches, said once its deployments are registered (and before it announces)."""
    return [line for line in console_lines(serve_log) if line.startswith("mergeflow: watching ")]


def test_serve_says_at_start_what_each_run_holds(served):
    _, run_dir, _, serve_log = served

    lines = console_lines(serve_log)

    assert f"mergeflow: watching {run_dir}: no complete checkpoint yet" in lines
    assert f"mergeflow: watching {run_dir.parent / EARLIER_RUN}: 1 complete checkpoint(s), 0 merged already, 1 to merge" in lines


def test_serve_says_each_checkpoint_it_announces_and_each_merge_it_finishes(served):
    _, _, output_dir, serve_log = served
    target = output_dir / "run-a" / "global_step_1" / "actor"
    wait_until(lambda: (target / "model.safetensors").is_file(), MERGE_SECONDS, "the merged model")

    wait_until(lambda: f"mergeflow: merged run-a/step-1/actor into {target}" in console_lines(serve_log), 30, "the merge's line")
    assert f"mergeflow: run-a/step-1/actor saved: merging it into {target}" in console_lines(serve_log)


def test_a_checkpoint_that_is_a_hugging_face_model_already_is_copied_and_validated(served, fixtures):
    _, run_dir, output_dir, _ = served

    hf_model_only(fixtures["qwen2-ws2"], run_dir, 3)

    target = output_dir / "run-a" / "global_step_3" / "actor"
    wait_until(lambda: (target / "model.safetensors").is_file(), MERGE_SECONDS, "the copied model")
    assert validate_model_dir(target, reference_dir=fixtures["qwen2-ws2"].reference_dir).passed
