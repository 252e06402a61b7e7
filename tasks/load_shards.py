from prefect import get_run_logger

from mergeflow.job import MergeJob, ShardsLoaded
from mergeflow.tasks.cache import merge_step


@merge_step("load-shards")
def load_shards(job: MergeJob) -> ShardsLoaded:
    """Read the shards' metadata (FSDP rank files memory-mapped, or a Megatron archive's `.metadata` mapped
    onto Hugging Face names through the config); tensor data stays on disk."""
    shards = job.load_shards()
    facts = ", ".join(f"{name} {value}" for name, value in shards.facts.items() if value is not None)
    get_run_logger().info("%d tensors (%s)", shards.tensors, facts)
    return shards
