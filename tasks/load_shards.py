from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from mergeflow.fsdp import RankFiles, ShardIndex, index_shards


@task(name="load-shards", cache_policy=NO_CACHE)
def load_shards(rank_files: RankFiles) -> ShardIndex:
    """Read every rank file's metadata (memory-mapped, weights_only); tensor data stays on disk."""
    index = index_shards(rank_files)
    get_run_logger().info(
        "%d tensors on mesh %s %s",
        len(index.tensors),
        index.mesh_shape,
        index.mesh_dim_names or "(plain tensors)",
    )
    return index
