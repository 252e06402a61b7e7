from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from mergeflow.formats.fsdp.index import ShardIndex
from mergeflow.lora import LoraPlan, plan_lora
from mergeflow.options import DEFAULT_DTYPE
from mergeflow.planning import AdapterPlan, plan_adapter
from mergeflow.spec.model_spec import ModelSpec


@task(name="extract-lora", cache_policy=NO_CACHE)
def extract_lora(
    index: ShardIndex,
    spec: ModelSpec,
    *,
    merge_lora: bool = False,
    lora_alpha: float | None = None,
    dtype: str = DEFAULT_DTYPE,
) -> tuple[LoraPlan | None, AdapterPlan | None]:
    """Find LoRA tensors and rebuild the adapter's PEFT config; plan the adapter unless LoRA is folded in."""
    lora = plan_lora(index, spec, merge=merge_lora, lora_alpha=lora_alpha)
    logger = get_run_logger()
    if lora is None:
        logger.info("no LoRA tensors")
        return None, None
    config = lora.config
    logger.info(
        "LoRA adapter '%s': r=%s, lora_alpha=%s (from %s), target_modules=%s%s%s",
        lora.adapter_name,
        config.r,
        config.lora_alpha,
        lora.alpha_source,
        sorted(config.target_modules),
        f", rank_pattern={config.rank_pattern}" if config.rank_pattern else "",
        ", DoRA" if config.use_dora else "",
    )
    for note in lora.notes:
        logger.warning(note)
    if lora.merge:
        logger.info("folding LoRA into %d base weight(s)", len(lora.folds))
        return lora, None
    return lora, plan_adapter(index, lora, dtype=dtype)
