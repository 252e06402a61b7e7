"""verl's `test` operation: compare a checkpoint's merged tensors with a reference model, writing nothing."""

import time
from pathlib import Path

from prefect import flow

from mergeflow.errors import OptionError, ValidationError
from mergeflow.options import check_backend
from mergeflow.preflight import config_dir_of
from mergeflow.tasks.compare_checkpoint import compare_checkpoint
from mergeflow.tasks.detect_world_size import detect_world_size
from mergeflow.tasks.extract_lora import extract_lora
from mergeflow.tasks.load_config import load_config
from mergeflow.tasks.load_shards import load_shards
from mergeflow.tasks.merge import merge
from mergeflow.tasks.publish_report import publish_report
from mergeflow.validation.validate import ValidationReport, reference_dtype_choice


@flow(name="test-checkpoint")
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
    started = time.monotonic()
    check_backend(backend)

    source = detect_world_size(local_dir, backend)
    spec = load_config(
        local_dir,
        str(config_dir_of(source, hf_model_config_path)),
        trust_remote_code=trust_remote_code, is_value_model=is_value_model
    )
    index = load_shards(source, spec)
    dtype = dtype or reference_dtype_choice(Path(test_hf_dir))
    lora, _ = extract_lora(index, spec, merge_lora=merge_lora, lora_alpha=lora_alpha, dtype=dtype)
    plan = merge(index, spec, dtype=dtype, lora=lora)
    if plan is None:
        raise OptionError(f"{local_dir} is a LoRA-only checkpoint: it holds no base model to compare")
    report = compare_checkpoint(plan, index, spec, test_hf_dir, atol=atol, rtol=rtol)
    publish_report(index, plan, report, saved=None, lora=lora, seconds=time.monotonic() - started)

    if not report.passed:
        raise ValidationError(report.failure_message())
    return report
