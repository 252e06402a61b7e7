"""verl's `test` operation: compare a checkpoint's merged tensors with a reference model, writing nothing."""

import dataclasses
from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner

from mergeflow.errors import ValidationError
from mergeflow.flows.merge import SHARD_WORKERS
from mergeflow.flows.prepare import prepare
from mergeflow.flows.task_runners import weight_file_task_resources
from mergeflow.job import MergeJob
from mergeflow.options import DEFAULT_OPTIONS, MergeOptions, Reference
from mergeflow.run_layout import label_of
from mergeflow.tasks.compare_checkpoint import compare_checkpoint
from mergeflow.tasks.detect_world_size import detect_world_size
from mergeflow.tasks.fingerprint import fingerprint
from mergeflow.validation.report import ValidationReport
from mergeflow.validation.validate import combined, reference_dtype_choice


def verify_run_name() -> str:
    """`test run-a/step-120/actor` in the Prefect UI."""
    return f"test {label_of(flow_run.parameters['local_dir'])}"


@flow(name="test-checkpoint", flow_run_name=verify_run_name, task_runner=ThreadPoolTaskRunner(max_workers=SHARD_WORKERS))
def verify_checkpoint(
    local_dir: str,
    reference: Reference,
    options: MergeOptions = DEFAULT_OPTIONS,
    in_reference_dtype: bool = True,
) -> ValidationReport:
    """Merge in place and compare with the reference, in the reference's dtype (`in_reference_dtype`) or in
    `options.dtype`, one task run per weight file the merge would write (on the flow's task runner). For a LoRA
    checkpoint the base model is compared, or with `options.merge_lora` the base with LoRA folded in."""
    if in_reference_dtype:
        options = dataclasses.replace(options, dtype=reference_dtype_choice(Path(reference.test_hf_dir)))
    job = MergeJob(local_dir, None, options)
    key = fingerprint(job)
    checkpoint = detect_world_size(job, wait_for=[key])
    merged = prepare(job, checkpoint)
    with weight_file_task_resources(job.chunk_bytes):
        key_sets = compare_checkpoint.submit(job, reference, key_sets_only=True, wait_for=[merged.plan])
        parts = [compare_checkpoint.submit(job, reference, weight_file=name, wait_for=[merged.plan])
                 for name in merged.plan.weight_files]  # fmt: skip
    report = combined([key_sets.result(), *(part.result() for part in parts)])
    if not report.passed:
        raise ValidationError(report.failure_message())
    return report
