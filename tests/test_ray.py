"""The weight-file writes run as Ray tasks spread over a real Ray cluster of two nodes on 127.0.0.1, with the output
of the thread pool; a lost node's writes run again on the other, and a run that cannot finish leaves nothing."""

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from mergeflow.errors import OptionError
from mergeflow.flows.merge import merge_checkpoint
from mergeflow.flows.task_runners import check_task_runner, task_runner_from
from mergeflow.options import MergeOptions
from tests.ray_cluster import LocalRayCluster
from tests.ray_stall import HOOK, STALL_VARIABLE

REPO = Path(__file__).resolve().parents[1]
SHARD_SIZE = "12KB"
STATE_API_SECONDS = 30
KILL_WAIT_SECONDS = 120

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]  # one cluster, on one pytest-xdist worker


def merged_files(folder: Path) -> dict[str, bytes]:
    """Every file's bytes, but the model card (it records the merge time)."""
    return {path.name: path.read_bytes() for path in folder.iterdir() if path.name != "README.md"}


def merge_on(runner, checkpoint_dir: Path, target_dir: Path, **options):
    """Merge in small weight files on `runner` (a spec, or a task runner)."""
    runner = task_runner_from(runner) if isinstance(runner, str) else runner
    return merge_checkpoint.with_options(task_runner=runner)(
        local_dir=str(checkpoint_dir),
        target_dir=str(target_dir),
        options=MergeOptions(max_shard_size=SHARD_SIZE, **options),
        progress=False,
    )


@pytest.fixture(scope="module")
def ray_cluster(prefect_server):
    """A head and one worker node, one CPU each; Ray workers can import the tests (for the stall hook) and report
    to the suite's Prefect server."""
    temp_dir = Path(tempfile.mkdtemp(prefix="cluster-", dir=os.environ["RAY_TMPDIR"]))
    cluster = LocalRayCluster(temp_dir, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        yield cluster.start(worker_nodes=1)
    finally:
        cluster.stop()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def eight_rank_threads_output(eight_rank_fixture, prefect_server, tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("threads") / "merged"
    merge_on("threads", eight_rank_fixture.checkpoint_dir, target)
    return target


def write_task_ids(cluster: LocalRayCluster) -> set[str]:
    """The ids of the `write-shard` Ray tasks the cluster has run so far."""
    from ray.util.state import list_tasks

    return {task.task_id for task in list_tasks(address=cluster.dashboard, filters=[("name", "=", "write-shard")], limit=10_000)}


def write_task_nodes(cluster: LocalRayCluster, before: set[str], count: int) -> list[str]:
    """The node of each of the `count` `write-shard` Ray tasks that finished since `before` (the state API sees
    them a little late)."""
    from ray.util.state import list_tasks

    deadline = time.monotonic() + STATE_API_SECONDS
    while True:
        tasks = list_tasks(address=cluster.dashboard, filters=[("name", "=", "write-shard")], detail=True, limit=10_000)
        finished = [task for task in tasks if task.task_id not in before and task.state == "FINISHED"]
        if len(finished) >= count or time.monotonic() > deadline:
            return [task.node_id for task in finished]
        time.sleep(1)


@pytest.mark.parametrize(
    ("fixture", "options"),
    [
        pytest.param("qwen2-ws8", {}, id="fsdp-8-ranks"),
        pytest.param("qwen2-ws8", {"quantize": "fp8"}, id="fsdp-fp8"),
        pytest.param("lora-ws2", {"merge_lora": True}, id="fsdp-lora-folded"),
    ],
)
def test_ray_merge_equals_the_thread_pool_merge(fixture, options, ray_cluster, fixtures, eight_rank_fixture, tmp_path):
    checkpoint = (eight_rank_fixture if fixture == "qwen2-ws8" else fixtures[fixture]).checkpoint_dir
    merge_on("threads", checkpoint, tmp_path / "threads", **options)

    saved = merge_on(f"ray:{ray_cluster.address}", checkpoint, tmp_path / "ray", **options)

    assert len(saved.weight_files) > 1
    assert merged_files(tmp_path / "ray") == merged_files(tmp_path / "threads")


def test_megatron_ray_merge_equals_the_thread_pool_merge(ray_cluster, megatron_fixtures, tmp_path):
    checkpoint = megatron_fixtures["megatron-qwen2-tied-tp2-pp2"].checkpoint_dir
    merge_on("threads", checkpoint, tmp_path / "threads", backend="megatron")

    saved = merge_on(f"ray:{ray_cluster.address}", checkpoint, tmp_path / "ray", backend="megatron")

    assert len(saved.weight_files) > 1
    assert merged_files(tmp_path / "ray") == merged_files(tmp_path / "threads")


def test_the_test_flow_compares_on_the_ray_cluster(ray_cluster, eight_rank_fixture):
    from mergeflow.flows.verify import verify_checkpoint
    from mergeflow.options import Reference

    report = verify_checkpoint.with_options(task_runner=task_runner_from(f"ray:{ray_cluster.address}"))(
        local_dir=str(eight_rank_fixture.checkpoint_dir),
        reference=Reference(str(eight_rank_fixture.reference_dir)),
        options=MergeOptions(max_shard_size=SHARD_SIZE),
    )

    assert report.passed
    assert report.tensors_compared > 0


def test_writes_run_as_ray_tasks_on_both_nodes_of_ray_address(
    ray_cluster, eight_rank_fixture, eight_rank_threads_output, tmp_path, monkeypatch
):
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster.address)
    before = write_task_ids(ray_cluster)

    saved = merge_on("ray", eight_rank_fixture.checkpoint_dir, tmp_path / "ray")

    nodes = write_task_nodes(ray_cluster, before, count=len(saved.weight_files))
    assert len(nodes) == len(saved.weight_files)
    assert set(nodes) == ray_cluster.node_ids()
    assert merged_files(tmp_path / "ray") == merged_files(eight_rank_threads_output)


def test_ray_client_address_runs_the_writes(ray_cluster, eight_rank_fixture, eight_rank_threads_output, tmp_path):
    merge_on(ray_cluster.client_address, eight_rank_fixture.checkpoint_dir, tmp_path / "ray")

    assert merged_files(tmp_path / "ray") == merged_files(eight_rank_threads_output)


@pytest.mark.usefixtures("prefect_server")
def test_local_ray_started_for_the_run_writes_the_same_files(
    eight_rank_fixture, eight_rank_threads_output, tmp_path, monkeypatch
):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)

    merge_on("ray", eight_rank_fixture.checkpoint_dir, tmp_path / "ray")

    assert merged_files(tmp_path / "ray") == merged_files(eight_rank_threads_output)


def stalled_node_killed(cluster: LocalRayCluster, started: Path) -> threading.Thread:
    """Add a node whose writes stall, and kill it once one has started; the thread returns when it is gone."""
    node = cluster.add_worker_node(**{STALL_VARIABLE: str(started)})

    def kill_when_stalled() -> None:
        deadline = time.monotonic() + KILL_WAIT_SECONDS
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        cluster.kill_node(node)

    killer = threading.Thread(target=kill_when_stalled, daemon=True)
    killer.start()
    return killer


@pytest.fixture
def stalling_ray_runner(ray_cluster, tmp_path):
    """A Ray task runner on a cluster that gets a third node whose writes stall; the node is killed mid-write."""
    from mergeflow.flows.ray_runner import RayTaskRunnerShutDownOnFailure

    started = tmp_path / "stalled-write-started"
    killer = stalled_node_killed(ray_cluster, started)
    yield RayTaskRunnerShutDownOnFailure(address=ray_cluster.address, init_kwargs={"runtime_env": {"worker_process_setup_hook": HOOK}})
    killer.join(KILL_WAIT_SECONDS)
    assert started.exists(), "no write ran on the stalled node"


def test_writes_of_a_killed_node_run_again_on_the_others(
    stalling_ray_runner, eight_rank_fixture, eight_rank_threads_output, tmp_path
):
    saved = merge_on(stalling_ray_runner, eight_rank_fixture.checkpoint_dir, tmp_path / "ray")

    assert saved.folder == str(tmp_path / "ray")
    assert merged_files(tmp_path / "ray") == merged_files(eight_rank_threads_output)
    assert {path.name for path in tmp_path.iterdir()} == {"ray", "stalled-write-started"}


def test_a_run_that_loses_a_write_for_good_leaves_nothing_and_the_next_run_completes(
    stalling_ray_runner, eight_rank_fixture, eight_rank_threads_output, tmp_path
):
    from prefect_ray.context import remote_options

    target = tmp_path / "ray"
    with remote_options(max_retries=0), pytest.raises(Exception, match=r"(?i)died|crash|lost|unavailable"):
        merge_on(stalling_ray_runner, eight_rank_fixture.checkpoint_dir, target)
    assert not target.exists()
    assert {path.name for path in tmp_path.iterdir()} == {"stalled-write-started"}

    merge_on("threads", eight_rank_fixture.checkpoint_dir, target)
    assert merged_files(target) == merged_files(eight_rank_threads_output)


def test_ray_specs_name_the_cluster():
    assert task_runner_from("ray:10.0.0.5:6379").address == "10.0.0.5:6379"
    assert task_runner_from("ray://10.0.0.5:10001").address == "ray://10.0.0.5:10001"


def test_ray_without_an_address_starts_a_local_ray_unless_ray_address_is_set(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert task_runner_from("ray").address is None

    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    assert task_runner_from("ray").address is None  # ray.init reads RAY_ADDRESS itself


def test_an_unreachable_ray_cluster_is_named_before_the_run(monkeypatch):
    from mergeflow.demo.fsdp import _free_port

    address = f"127.0.0.1:{_free_port()}"
    with pytest.raises(OptionError, match=f"the Ray cluster at {address} does not answer"):
        check_task_runner(f"ray:{address}")
    monkeypatch.setenv("RAY_ADDRESS", address)
    with pytest.raises(OptionError, match=f"the Ray cluster at {address} does not answer"):
        check_task_runner("ray")


def test_a_ray_address_without_a_port_is_refused():
    with pytest.raises(OptionError, match="use HOST:PORT or ray://HOST:PORT"):
        check_task_runner("ray:headnode")


def test_the_ray_runner_without_its_extra_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "prefect_ray", None)
    with pytest.raises(OptionError, match=r"pip install 'mergeflow\[ray\]'"):
        check_task_runner("ray")
    with pytest.raises(OptionError, match=r"pip install 'mergeflow\[ray\]'"):
        task_runner_from("ray")


def test_merge_command_writes_on_the_ray_cluster(ray_cluster, eight_rank_fixture, eight_rank_threads_output, tmp_path):
    before = write_task_ids(ray_cluster)
    command = [
        sys.executable, "-m", "mergeflow", "merge", "--local_dir", str(eight_rank_fixture.checkpoint_dir),
        "--target_dir", str(tmp_path / "cli"), "--max-shard-size", SHARD_SIZE, "--task-runner", f"ray:{ray_cluster.address}",
        "--no-progress",
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, cwd=tmp_path)

    written = [path for path in (tmp_path / "cli").iterdir() if path.suffix == ".safetensors"]
    assert merged_files(tmp_path / "cli") == merged_files(eight_rank_threads_output)
    assert set(write_task_nodes(ray_cluster, before, count=len(written))) == ray_cluster.node_ids()


def test_a_ray_start_that_fails_shuts_this_processs_ray_down(monkeypatch):
    """A `ray.init` that failed part way would fail every later one in the process (a serve, a test run)."""
    import ray

    shut_down = []

    def failing_init(*args, **kwargs):
        raise ConnectionAbortedError("Starting Ray client server failed")

    monkeypatch.setattr(ray, "init", failing_init)
    monkeypatch.setattr(ray, "shutdown", lambda: shut_down.append(True))

    with pytest.raises(ConnectionAbortedError), task_runner_from("ray://127.0.0.1:10001"):
        pass

    assert shut_down == [True]
