from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from mergeflow.fsdp import ShardIndex
from mergeflow.hf_config import ModelSpec
from mergeflow.planning import AdapterPlan, MergePlan
from mergeflow.save import SavedModel, save_model


@task(name="save", cache_policy=NO_CACHE)
def save(
    plan: MergePlan | None,
    index: ShardIndex,
    spec: ModelSpec,
    target_dir: str,
    *,
    adapter: AdapterPlan | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> SavedModel:
    """Stream the merged tensors (and the LoRA adapter) into safetensors files; write the folder atomically."""
    saved = save_model(
        plan, index, spec, Path(target_dir), adapter=adapter, overwrite=overwrite, progress=progress
    )
    get_run_logger().info(
        "wrote %s: %d files, %d bytes of weights in %.1fs",
        saved.target_dir,
        len(saved.files),
        saved.total_size,
        saved.seconds,
    )
    return saved
