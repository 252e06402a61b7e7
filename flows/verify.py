"""verl's `test` operation: compare a checkpoint's merged tensors with a reference model, writing nothing."""

from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run

from mergeflow.errors import ValidationError
from mergeflow.job import MergeJob
from mergeflow.options import MergeOptions
from mergeflow.run_layout import label_of
from mergeflow.tasks.compare_checkpoint import compare_checkpoint
from mergeflow.tasks.detect_world_size import detect_world_size
from mergeflow.tasks.extract_lora import extract_lora
from mergeflow.tasks.fingerprint import fingerprint
from mergeflow.tasks.load_config import load_config
from mergeflow.tasks.load_shards import load_shards
from mergeflow.tasks.plan_merge import plan_merge
from mergeflow.validation.report import ValidationReport
from mergeflow.validation.validate import reference_dtype_choice


def verify_run_name() -> str:
    """`test run-a/step-120/actor` in the Prefect UI."""
    return f"test {label_of(flow_run.parameters['local_dir'])}"


@flow(name="test-checkpoint", flow_run_name=verify_run_name)
def verify_checkpoint(
    local_dir: str,
    test_hf_dir: str,
    backend: str = "fsdp",
    dtype: str | None = None,
    hf_model_config_path: str | None = None,
    trust_remote_code: bool = False,
    is_value_model: bool = False,
    merge_lora: bool = False,
    lora_alpha: float | None = None,
    atol: float = 0.0,
    rtol: float = 0.0,
) -> ValidationReport:
    """Merge in place and compare with `test_hf_dir`; `dtype` defaults to the reference's.

    For a LoRA checkpoint the base model is compared, or with `merge_lora` the base with LoRA folded in.
    """
    options = MergeOptions(
        backend=backend, dtype=dtype or reference_dtype_choice(Path(test_hf_dir)), hf_model_config_path=hf_model_config_path,
        trust_remote_code=trust_remote_code, is_value_model=is_value_model, merge_lora=merge_lora, lora_alpha=lora_alpha,
    )  # fmt: skip
    job = MergeJob(local_dir, None, options)
    key = fingerprint(job)
    checkpoint = detect_world_size(job, key)
    config = load_config(job, checkpoint)
    shards = load_shards(job, config)
    lora = extract_lora(job, shards)
    plan = plan_merge(job, lora)
    report = compare_checkpoint(job, plan, test_hf_dir, atol=atol, rtol=rtol)
    if not report.passed:
        raise ValidationError(report.failure_message())
    return report
