from prefect import get_run_logger

from mergeflow.job import CheckpointFound, MergeJob
from mergeflow.tasks.cache import merge_step


@merge_step("detect-world-size")
def detect_world_size(job: MergeJob) -> CheckpointFound:
    """Find the checkpoint's files in its backend's layout and check they are complete: FSDP's rank files 0..W-1
    and no other; a Megatron archive and its `huggingface/` folder in either of verl's layouts."""
    found = job.find_checkpoint()
    if found.model_dir:
        get_run_logger().info("%s holds the Hugging Face model already", found.model_dir)
    else:
        get_run_logger().info(
            "%s checkpoint of world size %d: %d data files in %s",
            found.backend, found.world_size, found.data_files, found.checkpoint_dir,
        )  # fmt: skip
    return found
