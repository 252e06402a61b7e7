"""The per-shard merge tasks run on a Dask cluster as on the local thread pool, with the same output."""

import re

import pytest

from mergeflow.errors import OptionError
from mergeflow.flows.merge import merge_checkpoint
from mergeflow.flows.task_runners import SPEC_HELP, task_runner_from
from mergeflow.options import MergeOptions

SHARD_SIZE = "12KB"


def merged_files(folder):
    """Every file's bytes, but the model card (it records the merge time)."""
    return {path.name: path.read_bytes() for path in folder.iterdir() if path.name != "README.md"}


def merge_on(task_runner: str, fixtures, target_dir):
    """Merge the qwen2-ws2 fixture in small shards with the given task runner."""
    return merge_checkpoint.with_options(task_runner=task_runner_from(task_runner))(
        local_dir=str(fixtures["qwen2-ws2"].checkpoint_dir),
        target_dir=str(target_dir),
        options=MergeOptions(max_shard_size=SHARD_SIZE),
        progress=False,
    )


@pytest.fixture(scope="module")
def thread_pool_output(fixtures, prefect_server, tmp_path_factory):
    """The same merge on the default thread pool, once for the module."""
    target = tmp_path_factory.mktemp("threads") / "merged"
    merge_on("threads", fixtures, target)
    return target


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_server")
def test_dask_local_cluster_output_equals_the_thread_pool_output(fixtures, thread_pool_output, tmp_path):
    saved = merge_on("dask:2", fixtures, tmp_path / "dask")

    assert len(saved.weight_files) > 1
    assert merged_files(tmp_path / "dask") == merged_files(thread_pool_output)


def test_unknown_task_runner_is_refused_with_the_accepted_forms():
    with pytest.raises(OptionError, match=re.escape(f"task runner 'slurm': use {SPEC_HELP}")):
        task_runner_from("slurm")


@pytest.mark.parametrize("spec", ["threads:0", "threads:x", "dask:-1"])
def test_worker_count_must_be_a_positive_number(spec):
    with pytest.raises(OptionError, match="is not a positive number of workers"):
        task_runner_from(spec)


def test_dask_address_names_the_scheduler():
    assert task_runner_from("dask://10.0.0.5:8786").address == "tcp://10.0.0.5:8786"


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_server")
def test_an_existing_clusters_scheduler_runs_the_shards(fixtures, thread_pool_output, tmp_path):
    from distributed import LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=2, processes=True, dashboard_address=None) as cluster:
        address = cluster.scheduler_address.removeprefix("tcp:")
        saved = merge_on(f"dask:{address}", fixtures, tmp_path / "cluster")

    assert len(saved.weight_files) > 1
    assert merged_files(tmp_path / "cluster") == merged_files(thread_pool_output)
