from prefect import get_run_logger
from tqdm.auto import tqdm

from mergeflow.job import MergeJob, PlanMade
from mergeflow.output.manifest import ShardWritten, how_written
from mergeflow.sizes import human_size
from mergeflow.tasks.cache import merge_step


@merge_step("write-shard", task_run_name="write {filename}")
def write_shard(job: MergeJob, plan: PlanMade, filename: str, *, progress: bool = False) -> ShardWritten:
    """Stream one weight file into the staging folder; a file already there as planned (written ahead while
    Prefect started, or by an interrupted run) is kept. Its progress bar leaves the terminal when it closes."""
    size = plan.weight_files[filename]
    with tqdm(total=size, unit="B", unit_scale=True, desc=filename, leave=False, disable=None if progress else True) as bar:
        written = job.write_shard(filename, on_bytes=bar.update)
    get_run_logger().info("%s: %s %s", filename, human_size(written.size), how_written(written))
    return written
