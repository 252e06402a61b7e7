from prefect import get_run_logger

from mergeflow.job import ConfigLoaded, MergeJob
from mergeflow.tasks.cache import merge_step


@merge_step("load-config")
def load_config(job: MergeJob) -> ConfigLoaded:
    """Read the Hugging Face config saved with the checkpoint (or given explicitly) into a model spec."""
    config = job.load_config()
    tied = ", ".join(f"{alias} -> {kept}" for alias, kept in config.tied.items()) or "none"
    get_run_logger().info(
        "%s from %s: %d tensors expected, tied: %s", config.model_class, config.config_dir, config.tensors, tied
    )
    return config
