from prefect import get_run_logger
from tqdm.auto import tqdm

from mergeflow.job import MergeJob, PlanMade
from mergeflow.output.manifest import ShardWritten
from mergeflow.tasks.cache import merge_step


@merge_step("write-shard", task_run_name="write {filename}")
def write_shard(job: MergeJob, plan: PlanMade, filename: str, *, progress: bool = False) -> ShardWritten:
    """Stream one weight file into the staging folder; a file already there as planned (written before the
    flow started, or by an interrupted run) is kept."""
    with tqdm(total=plan.weight_files[filename], unit="B", unit_scale=True, desc=filename, leave=False, disable=None if progress else True) as bar:
        written = job.write_shard(filename, on_bytes=bar.update)
    if written.resumed:
        get_run_logger().info("%s: already written (%d bytes), kept", filename, written.size)
    else:
        get_run_logger().info("%s: %d bytes written", filename, written.size)
    return written
