from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from mergeflow.fingerprint import MergeKey, merge_key


@task(name="fingerprint", cache_policy=NO_CACHE)
def fingerprint(local_dir: str, target_dir: str, options: dict[str, object]) -> MergeKey:
    """The merge's cache key from the checkpoint's (and an outside config folder's) file sizes and mtimes."""
    inputs = [Path(local_dir)]
    config_dir = options.get("hf_model_config_path")
    if config_dir and not Path(config_dir).absolute().is_relative_to(Path(local_dir).absolute()):
        inputs.append(Path(config_dir))
    key = merge_key(inputs, Path(target_dir), options)
    get_run_logger().info("fingerprint %s: %d files, %d bytes", key.digest[:12], key.files, key.bytes)
    return key
