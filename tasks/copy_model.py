from prefect import get_run_logger

from mergeflow.job import CheckpointFound, MergeJob
from mergeflow.output.manifest import SavedModel
from mergeflow.tasks.cache import merge_step


@merge_step("copy-model")
def copy_model(job: MergeJob, checkpoint: CheckpointFound, *, replace: bool = False) -> SavedModel:
    """Copy a checkpoint's ready Hugging Face model folder (an mbridge run's) byte for byte, to validate."""
    saved = job.copy_model(replace=replace)
    get_run_logger().info(
        "%s already holds the Hugging Face model: nothing to merge; copied %d files, %d tensors",
        checkpoint.model_dir, len(saved.files), saved.num_tensors,
    )  # fmt: skip
    return saved
