"""Validate a merged folder, e.g. one copied from elsewhere: completeness, and a reference when given."""

from prefect import flow

from mergeflow.errors import ValidationError
from mergeflow.tasks.validate import validate_folder
from mergeflow.validation.report import ValidationReport


@flow(name="validate-model", flow_run_name="validate {target_dir}")
def validate_model(
    target_dir: str,
    test_hf_dir: str | None = None,
    check_logits: bool = False,
    atol: float = 0.0,
    rtol: float = 0.0,
) -> ValidationReport:
    report = validate_folder(target_dir, test_hf_dir, check_logits=check_logits, atol=atol, rtol=rtol)
    if not report.passed:
        raise ValidationError(report.failure_message())
    return report
