from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from mergeflow.formats.fsdp.index import ShardIndex
from mergeflow.lora import LoraPlan
from mergeflow.options import DEFAULT_DTYPE, MAX_SHARD_SIZE
from mergeflow.planning import MergePlan, plan_merge
from mergeflow.spec.model_spec import ModelSpec


@task(name="merge", cache_policy=NO_CACHE)
def merge(
    index: ShardIndex,
    spec: ModelSpec,
    *,
    dtype: str = DEFAULT_DTYPE,
    max_shard_size: str = MAX_SHARD_SIZE,
    lora: LoraPlan | None = None,
) -> MergePlan | None:
    """Resolve every tensor's shards against the config: names, shapes, dtype, ties, and output files.

    None for a LoRA-only checkpoint, which has no base model to merge.
    """
    logger = get_run_logger()
    if lora is not None and lora.lora_only:
        logger.info("LoRA-only checkpoint: no base model to merge")
        return None
    plan = plan_merge(index, spec, dtype=dtype, max_shard_size=max_shard_size, lora=lora)
    logger.info(
        "%d tensors, %d bytes in %d file(s), dtype %s",
        len(plan.tensors),
        plan.total_size,
        len(plan.shard_to_names),
        plan.config_dtype,
    )
    if plan.dropped_aliases:
        logger.info("tied aliases not written: %s", ", ".join(sorted(plan.dropped_aliases)))
    if plan.unexpected:
        logger.warning(
            "tensors the config's model does not declare (written anyway): %s", ", ".join(plan.unexpected)
        )
    return plan
