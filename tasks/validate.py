from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from mergeflow.validation.validate import ValidationReport, validate_model_dir


@task(name="validate", cache_policy=NO_CACHE)
def validate(
    model_dir: str,
    test_hf_dir: str | None = None,
    *,
    check_logits: bool = False,
    atol: float = 0.0,
    rtol: float = 0.0,
    target_dir: str | None = None,
) -> ValidationReport:
    """Check a merged folder is complete and, given a reference, equal to it tensor by tensor; the report
    names `target_dir` (where a staged folder is going) when given."""
    report = validate_model_dir(
        Path(model_dir),
        reference_dir=Path(test_hf_dir) if test_hf_dir else None,
        check_logits=check_logits,
        atol=atol,
        rtol=rtol,
        shown_as=target_dir,
    )
    logger = get_run_logger()
    if report.passed:
        logger.info("validation %s", report.verdict())
    else:
        logger.error(report.failure_message())
    return report
