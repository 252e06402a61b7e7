"""The merge pipeline: a verl checkpoint into a validated Hugging Face model folder, one task run per step."""

import dataclasses
from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.tasks import exponential_backoff

from mergeflow.flows.prepare import prepare
from mergeflow.flows.task_runners import weight_file_task_resources
from mergeflow.hub import default_revision, training_step
from mergeflow.job import MergeJob
from mergeflow.options import DEFAULT_OPTIONS, HubUpload, MergeOptions, Reference, check_repo_id
from mergeflow.output.manifest import SavedModel
from mergeflow.run_layout import label_of
from mergeflow.tasks.cache import merge_transaction
from mergeflow.tasks.copy_model import copy_model
from mergeflow.tasks.detect_world_size import detect_world_size
from mergeflow.tasks.fingerprint import fingerprint
from mergeflow.tasks.publish import publish
from mergeflow.tasks.save import save
from mergeflow.tasks.upload import upload
from mergeflow.tasks.validate import validate
from mergeflow.tasks.write_model_card import write_model_card
from mergeflow.tasks.write_shard import write_shard

SHARD_WORKERS = 2
"""Weight files written at once by the default (thread pool) task runner."""
TARGET_NAME_PARTS = 4
"""How many of the target path's last parts a run's name shows."""


def merge_run_name() -> str:
    """`merge run-a/step-120/actor into models/run-a/global_step_120/actor` in the Prefect UI: the checkpoint and the
    last parts of the target (one checkpoint may be merged into several)."""
    target = Path(flow_run.parameters["target_dir"]).absolute()
    return f"merge {label_of(flow_run.parameters['local_dir'])} into {Path(*target.parts[-TARGET_NAME_PARTS:])}"


@flow(name="merge-checkpoint", flow_run_name=merge_run_name, task_runner=ThreadPoolTaskRunner(max_workers=SHARD_WORKERS))
def merge_checkpoint(
    local_dir: str,
    target_dir: str,
    options: MergeOptions = DEFAULT_OPTIONS,
    hub: HubUpload | None = None,
    reference: Reference | None = None,
    overwrite: bool = False,
    refresh_cache: bool = False,
    progress: bool = True,
) -> SavedModel:
    """Merge a verl checkpoint directory (`global_step_N/actor`) into a validated Hugging Face model folder.

    A merge whose inputs (by path, size and mtime), options, target and engine version are unchanged, and
    whose output is still in place, is a cache hit: every step shows Cached and nothing is read or written
    (`refresh_cache` forces a new merge). The merged folder is validated, against `reference` when given. A LoRA
    checkpoint gives the base model plus `lora_adapter/`, or with `options.merge_lora` the base model with the
    LoRA folded in. With `hub` the validated model is uploaded to the Hub, on `hub.revision` (default: a branch
    per training step, `step-N`); the token comes from HF_TOKEN, the huggingface_hub login, or the Prefect Secret
    block `hub.token_secret` names.
    """
    if hub is not None:
        check_repo_id(hub.repo_id)
    job = MergeJob(local_dir, target_dir, options)
    key = fingerprint(job)
    with merge_transaction(key, job.staging_dir, refresh=refresh_cache) as merge:
        replace = overwrite or merge.merged_before
        checkpoint = detect_world_size(job, wait_for=[key])
        if checkpoint.model_dir:  # the checkpoint holds the Hugging Face model already
            merged = None
            staged = copy_model(job, checkpoint, replace=replace)
        else:
            merged = prepare(job, checkpoint, replace=replace)
            with weight_file_task_resources(job.chunk_bytes):
                written = [write_shard.submit(job, merged.plan, name, progress=progress) for name in merged.plan.weight_files]
            staged = save(job, [future.result() for future in written], wait_for=[merged.plan])
        report = validate(job, staged, reference)
        card = write_model_card(job, staged, report, checkpoint, merged.lora if merged else None)
        saved = publish(job, staged, report, checkpoint, merged, replace=replace, wait_for=[card])
        merge.record(saved)
    if merge.reuse:
        saved = dataclasses.replace(saved, up_to_date=True)
    if hub is not None:
        checkpoint_dir = str(Path(local_dir).absolute())
        upload.with_options(
            retries=hub.retries, retry_delay_seconds=exponential_backoff(backoff_factor=hub.retry_delay_seconds)
        )(
            saved, hub, revision=hub.revision or default_revision(checkpoint_dir), checkpoint_dir=checkpoint_dir,
            commit_message=commit_message(checkpoint_dir, training_step(checkpoint_dir)),
        )  # fmt: skip
    return saved


def commit_message(checkpoint_dir: str, step: int | None) -> str:
    source = "/".join(Path(checkpoint_dir).parts[-3:])
    return f"Upload {source} merged by mergeflow" + (f" (training step {step})" if step is not None else "")
