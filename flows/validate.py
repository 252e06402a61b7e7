"""Validate a merged folder, e.g. one copied from elsewhere: completeness, and a reference when given."""

from prefect import flow

from mergeflow.errors import ValidationError
from mergeflow.options import Reference
from mergeflow.tasks.validate import validate_folder
from mergeflow.validation.report import ValidationReport


@flow(name="validate-model", flow_run_name="validate {target_dir}")
def validate_model(target_dir: str, reference: Reference | None = None) -> ValidationReport:
    report = validate_folder(target_dir, reference)
    if not report.passed:
        raise ValidationError(report.failure_message())
    return report
