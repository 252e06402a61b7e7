from prefect import get_run_logger

from mergeflow.fingerprint import MergeKey
from mergeflow.job import CheckpointFound, MergeJob
from mergeflow.tasks.cache import merge_step


@merge_step("detect-world-size")
def detect_world_size(job: MergeJob, key: MergeKey) -> CheckpointFound:
    """FSDP: find the rank files and check that every rank 0..W-1 is present, and no other. Megatron: find
    the `dist_ckpt/` archive and its `huggingface/` folder in either of verl's layouts."""
    found = job.find_checkpoint()
    if found.model_dir:
        get_run_logger().info("%s holds the Hugging Face model already (an mbridge run)", found.model_dir)
    else:
        get_run_logger().info(
            "%s checkpoint of world size %d: %d data files in %s",
            found.backend, found.world_size, found.data_files, found.checkpoint_dir,
        )  # fmt: skip
    return found
