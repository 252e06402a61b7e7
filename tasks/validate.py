from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from mergeflow.job import MergeJob
from mergeflow.options import Reference
from mergeflow.output.manifest import SavedModel
from mergeflow.tasks.cache import merge_step
from mergeflow.validation.report import ValidationReport


@merge_step("validate")
def validate(job: MergeJob, saved: SavedModel, reference: Reference | None = None) -> ValidationReport:
    """Check the merged folder is complete and, given a reference, equal to it tensor by tensor."""
    return _logged(job.validate(saved, reference))


@task(name="validate", cache_policy=NO_CACHE)
def validate_folder(target_dir: str, reference: Reference | None = None) -> ValidationReport:
    """Check a model folder (one copied from elsewhere) the way a merge checks its own."""
    from mergeflow.validation.validate import reference_arguments, validate_model_dir

    return _logged(validate_model_dir(Path(target_dir), **reference_arguments(reference)))


def _logged(report: ValidationReport) -> ValidationReport:
    if report.passed:
        get_run_logger().info("validation %s", report.verdict())
    else:
        get_run_logger().error(report.failure_message())
    return report
