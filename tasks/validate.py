from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from mergeflow.job import MergeJob
from mergeflow.output.manifest import SavedModel
from mergeflow.tasks.cache import merge_step
from mergeflow.validation.report import ValidationReport


@merge_step("validate")
def validate(
    job: MergeJob, saved: SavedModel, test_hf_dir: str | None = None, *, check_logits: bool = False
) -> ValidationReport:
    """Check the merged folder is complete and, given a reference, equal to it tensor by tensor."""
    return _logged(job.validate(saved, test_hf_dir, check_logits=check_logits))


@task(name="validate", cache_policy=NO_CACHE)
def validate_folder(
    target_dir: str,
    test_hf_dir: str | None = None,
    *,
    check_logits: bool = False,
    atol: float = 0.0,
    rtol: float = 0.0,
) -> ValidationReport:
    """Check a model folder (one copied from elsewhere) the way a merge checks its own."""
    from mergeflow.validation.validate import validate_model_dir

    report = validate_model_dir(
        Path(target_dir),
        reference_dir=Path(test_hf_dir) if test_hf_dir else None,
        check_logits=check_logits,
        atol=atol,
        rtol=rtol,
    )
    return _logged(report)


def _logged(report: ValidationReport) -> ValidationReport:
    if report.passed:
        get_run_logger().info("validation %s", report.verdict())
    else:
        get_run_logger().error(report.failure_message())
    return report
