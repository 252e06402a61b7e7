from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import task_run

from mergeflow.job import MergeJob
from mergeflow.options import Reference
from mergeflow.validation.report import ValidationReport


def compare_run_name() -> str:
    """`compare model-00001-of-00002.safetensors` in the UI, or `compare key sets`."""
    return f"compare {task_run.parameters.get('weight_file') or 'key sets'}"


@task(name="compare-checkpoint", task_run_name=compare_run_name, cache_policy=NO_CACHE)
def compare_checkpoint(
    job: MergeJob, reference: Reference, weight_file: str | None = None, key_sets_only: bool = False
) -> ValidationReport:
    """Compare the merged tensors, read straight from the checkpoint, with a reference (nothing is written): those
    `weight_file` would hold, or the key sets alone."""
    report = job.compare(reference, weight_file=weight_file, key_sets_only=key_sets_only)
    if report.passed:
        get_run_logger().info("%d tensors equal the reference %s", report.tensors_compared, reference.test_hf_dir)
    else:
        get_run_logger().error(report.failure_message())
    return report
