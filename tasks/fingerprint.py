from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from mergeflow.fingerprint import MergeKey
from mergeflow.job import MergeJob


@task(name="fingerprint", cache_policy=NO_CACHE)
def fingerprint(job: MergeJob) -> MergeKey:
    """The merge's cache key, from the checkpoint's (and an outside config folder's) file sizes and mtimes."""
    key = job.key()
    get_run_logger().info("fingerprint %s: %d files, %d bytes", key.digest[:12], key.files, key.bytes)
    return key
