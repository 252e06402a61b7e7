from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from tqdm.auto import tqdm

from mergeflow.formats.fsdp.index import ShardIndex
from mergeflow.output.save import ShardWritten
from mergeflow.output.save import write_shard as write_shard_file
from mergeflow.planning import MergePlan


@task(name="write-shard", cache_policy=NO_CACHE, task_run_name="write {filename}")
def write_shard(
    plan: MergePlan, index: ShardIndex, staging_dir: str, filename: str, *, progress: bool = False
) -> ShardWritten:
    """Stream one output safetensors file into the staging directory; a file already there as planned (an
    interrupted run's, or one written while the config was read) is kept."""
    size = sum(plan.tensors[name].nbytes for name in plan.shard_to_names[filename])
    with tqdm(total=size, unit="B", unit_scale=True, desc=filename, disable=not progress) as bar:
        written = write_shard_file(plan, index, Path(staging_dir), filename, on_bytes=bar.update)
    if written.resumed:
        get_run_logger().info("%s: already written (%d bytes), kept", filename, written.size)
    else:
        get_run_logger().info("%s: %d bytes written", filename, written.size)
    return written
