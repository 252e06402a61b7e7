"""The merge pipeline: a verl checkpoint into a validated Hugging Face model folder, one task run per step."""

import dataclasses
from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.tasks import exponential_backoff

from mergeflow.hub import default_revision, training_step
from mergeflow.job import MergeJob
from mergeflow.options import DEFAULT_DTYPE, MAX_SHARD_SIZE, MergeOptions, check_repo_id
from mergeflow.output.manifest import SavedModel
from mergeflow.run_layout import label_of
from mergeflow.tasks.cache import merge_transaction
from mergeflow.tasks.copy_model import copy_model
from mergeflow.tasks.detect_world_size import detect_world_size
from mergeflow.tasks.extract_lora import extract_lora
from mergeflow.tasks.fingerprint import fingerprint
from mergeflow.tasks.load_config import load_config
from mergeflow.tasks.load_shards import load_shards
from mergeflow.tasks.plan_merge import plan_merge
from mergeflow.tasks.publish import publish
from mergeflow.tasks.save import save
from mergeflow.tasks.upload import UPLOAD_RETRIES, UPLOAD_RETRY_DELAY_SECONDS, upload
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
    backend: str = "fsdp",
    dtype: str = DEFAULT_DTYPE,
    max_shard_size: str = MAX_SHARD_SIZE,
    hf_model_config_path: str | None = None,
    trust_remote_code: bool = False,
    is_value_model: bool = False,
    tie_word_embedding: bool = False,
    overwrite: bool = False,
    test_hf_dir: str | None = None,
    check_logits: bool = False,
    merge_lora: bool = False,
    lora_alpha: float | None = None,
    hf_upload_path: str | None = None,
    private: bool = False,
    revision: str | None = None,
    hf_token_secret: str | None = None,
    base_model: str | None = None,
    quantize: str | None = None,
    drop_mtp: bool = False,
    upload_retries: int = UPLOAD_RETRIES,
    upload_retry_delay_seconds: float = UPLOAD_RETRY_DELAY_SECONDS,
    refresh_cache: bool = False,
    progress: bool = True,
) -> SavedModel:
    """Merge a verl checkpoint directory (`global_step_N/actor`) into a validated Hugging Face model folder.

    A merge whose inputs (by path, size and mtime), options, target and engine version are unchanged, and
    whose output is still in place, is a cache hit: every step shows Cached and nothing is read or written
    (`refresh_cache` forces a new merge). A LoRA checkpoint gives the base model plus `lora_adapter/`, or
    with `merge_lora` the base model with the LoRA folded in; `quantize="fp8"` stores the linear layers'
    weights in FP8 with 128×128 block scales; `drop_mtp` leaves out multi-token-prediction layers. With
    `hf_upload_path` the validated model is uploaded to the Hub, on `revision` (default: a branch per
    training step, `step-N`); the token comes from HF_TOKEN, the huggingface_hub login, or the Prefect
    Secret block named by `hf_token_secret`.
    """
    if hf_upload_path:
        check_repo_id(hf_upload_path)
    options = MergeOptions(
        backend=backend, dtype=dtype, max_shard_size=max_shard_size, hf_model_config_path=hf_model_config_path,
        trust_remote_code=trust_remote_code, is_value_model=is_value_model, tie_word_embedding=tie_word_embedding,
        merge_lora=merge_lora, lora_alpha=lora_alpha, base_model=base_model, quantize=quantize, drop_mtp=drop_mtp,
    )  # fmt: skip
    job = MergeJob(local_dir, target_dir, options)
    key = fingerprint(job)
    with merge_transaction(key, job.staging_dir, refresh=refresh_cache) as merge:
        replace = overwrite or merge.merged_before
        checkpoint = detect_world_size(job, key)
        if checkpoint.model_dir:  # an mbridge run saved the Hugging Face model already
            staged = copy_model(job, checkpoint, replace=replace)
        else:
            config = load_config(job, checkpoint)
            shards = load_shards(job, config)
            lora = extract_lora(job, shards)
            plan = plan_merge(job, lora, replace=replace)
            written = [write_shard.submit(job, plan, filename, progress=progress) for filename in plan.weight_files]
            staged = save(job, plan, [future.result() for future in written])
        report = validate(job, staged, test_hf_dir, check_logits=check_logits)
        card = write_model_card(job, staged, report)
        saved = publish(job, staged, report, card, replace=replace)
        merge.record(saved)
    if merge.reuse:
        saved = dataclasses.replace(saved, up_to_date=True)
    if hf_upload_path:
        checkpoint_dir = str(Path(local_dir).absolute())
        upload.with_options(
            retries=upload_retries, retry_delay_seconds=exponential_backoff(backoff_factor=upload_retry_delay_seconds)
        )(
            saved, hf_upload_path, revision=revision or default_revision(checkpoint_dir), checkpoint_dir=checkpoint_dir,
            commit_message=commit_message(checkpoint_dir, training_step(checkpoint_dir)), private=private,
            token_secret=hf_token_secret,
        )  # fmt: skip
    return saved


def commit_message(checkpoint_dir: str, step: int | None) -> str:
    source = "/".join(Path(checkpoint_dir).parts[-3:])
    return f"Upload {source} merged by mergeflow" + (f" (training step {step})" if step is not None else "")
