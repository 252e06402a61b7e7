from prefect import get_run_logger

from mergeflow.job import MergeJob, PlanMade
from mergeflow.output.manifest import SavedModel, ShardWritten
from mergeflow.tasks.cache import merge_step


@merge_step("save")
def save(job: MergeJob, plan: PlanMade, shards: list[ShardWritten]) -> SavedModel:
    """Write the rest of the model folder beside its weight files: the weight index, config, generation config,
    tokenizer and other side files, the LoRA adapter. The manifest describes the staging folder."""
    saved = job.save(shards)
    kept = sum(shard.resumed for shard in shards)
    get_run_logger().info(
        "wrote %d files, %d bytes of weights%s",
        len(saved.files),
        saved.total_size,
        f" ({kept} weight file(s) kept from earlier: written before the flow started or by an interrupted run)" if kept else "",
    )
    return saved
