from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from mergeflow.job import MergeJob
from mergeflow.options import Reference
from mergeflow.validation.report import ValidationReport


@task(name="compare-checkpoint", cache_policy=NO_CACHE)
def compare_checkpoint(job: MergeJob, reference: Reference) -> ValidationReport:
    """Compare the merged tensors, read straight from the checkpoint, with a reference model (nothing is written)."""
    report = job.compare(reference)
    if report.passed:
        get_run_logger().info("%d tensors equal the reference %s", report.tensors_compared, reference.test_hf_dir)
    else:
        get_run_logger().error(report.failure_message())
    return report
