from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from mergeflow.validation import ValidationReport, validate_model_dir


@task(name="validate", cache_policy=NO_CACHE)
def validate(
    target_dir: str,
    test_hf_dir: str | None = None,
    *,
    check_logits: bool = False,
    atol: float = 0.0,
    rtol: float = 0.0,
) -> ValidationReport:
    """Check a merged folder is complete and, given a reference, equal to it tensor by tensor."""
    report = validate_model_dir(
        Path(target_dir),
        reference_dir=Path(test_hf_dir) if test_hf_dir else None,
        check_logits=check_logits,
        atol=atol,
        rtol=rtol,
    )
    _log(report)
    return report


def _log(report: ValidationReport) -> None:
    logger = get_run_logger()
    if report.passed:
        logger.info("validation passed: %s (%d tensors compared)", report.model_dir, report.tensors_compared)
    else:
        logger.error(report.failure_message())
    if report.logits is not None:
        logger.info(report.logits.message)
