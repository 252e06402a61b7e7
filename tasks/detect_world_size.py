from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from mergeflow.fsdp import RankFiles, find_rank_files


@task(name="detect-world-size", cache_policy=NO_CACHE)
def detect_world_size(local_dir: str) -> RankFiles:
    """Find the rank files and check that every rank 0..W-1 is present, and no other."""
    rank_files = find_rank_files(Path(local_dir))
    get_run_logger().info(
        "world size %d: %d rank files in %s", rank_files.world_size, len(rank_files.paths), local_dir
    )
    return rank_files
