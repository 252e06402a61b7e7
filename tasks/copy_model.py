from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from mergeflow.output.copy import copy_model_folder
from mergeflow.output.manifest import SavedModel


@task(name="copy-model", cache_policy=NO_CACHE)
def copy_model(hf_dir: str, staging_dir: str) -> SavedModel:
    """Copy a checkpoint's ready Hugging Face model folder byte for byte into the staging directory."""
    saved = copy_model_folder(Path(hf_dir), Path(staging_dir))
    get_run_logger().info(
        "%s already holds the Hugging Face model (an mbridge run): nothing to merge; copied %d files, "
        "%d tensors, to validate",
        hf_dir,
        len(saved.files),
        saved.num_tensors,
    )
    return saved
