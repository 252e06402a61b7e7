from collections import Counter

from prefect import get_run_logger

from mergeflow.job import MergeJob
from mergeflow.output.manifest import SavedModel, ShardWritten, how_written
from mergeflow.sizes import human_size
from mergeflow.tasks.cache import merge_step


@merge_step("save")
def save(job: MergeJob, shards: list[ShardWritten]) -> SavedModel:
    """Write the rest of the model folder beside its weight files: the weight index, config, generation config,
    tokenizer and other side files, the LoRA adapter. The manifest describes the staging folder."""
    saved = job.save(shards)
    origins = Counter(how_written(shard) for shard in shards if shard.resumed)
    get_run_logger().info(
        "%d files, %s of weights%s",
        len(saved.files),
        human_size(saved.total_size),
        "".join(f"; {count} weight file(s) {origin}" for origin, count in sorted(origins.items())),
    )
    return saved
