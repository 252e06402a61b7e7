"""The merge pipeline: world size, config, shards, LoRA, merge, save, validate, report, model card, upload."""

import time
from pathlib import Path

from prefect import flow
from prefect.tasks import exponential_backoff

from mergeflow.errors import OptionError, ValidationError
from mergeflow.hub import check_repo_id, default_revision, training_step
from mergeflow.lora import describe_lora
from mergeflow.model_card import MergeFacts
from mergeflow.output import check_target
from mergeflow.planning import DEFAULT_DTYPE, MAX_SHARD_SIZE
from mergeflow.save import SavedModel
from tasks.detect_world_size import default_config_dir_of, detect_world_size
from tasks.extract_lora import extract_lora
from tasks.load_config import load_config
from tasks.load_shards import load_shards
from tasks.merge import merge
from tasks.publish_report import publish_report
from tasks.save import save
from tasks.upload import UPLOAD_RETRIES, UPLOAD_RETRY_DELAY_SECONDS, upload
from tasks.validate import validate
from tasks.write_model_card import write_card

BACKENDS = ("fsdp", "megatron")


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise OptionError(f"backend '{backend}' is not supported yet: choose one of {', '.join(BACKENDS)}")


@flow(name="merge-checkpoint")
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
    upload_retries: int = UPLOAD_RETRIES,
    upload_retry_delay_seconds: float = UPLOAD_RETRY_DELAY_SECONDS,
    progress: bool = True,
) -> SavedModel:
    """Merge a verl checkpoint directory (`global_step_N/actor`) into a validated Hugging Face model folder.

    A LoRA checkpoint gives the base model plus `lora_adapter/`, or with `merge_lora` the base model
    with the LoRA folded in. With `hf_upload_path` the validated model is uploaded to the Hub, on
    `revision` (default: a branch per training step, `step-N`); the token comes from HF_TOKEN, the
    huggingface_hub login, or the Prefect Secret block named by `hf_token_secret`.
    """
    started = time.monotonic()
    check_backend(backend)
    check_target(Path(target_dir), overwrite=overwrite)
    if hf_upload_path:
        check_repo_id(hf_upload_path)

    source = detect_world_size(local_dir, backend)
    spec = load_config(
        local_dir,
        hf_model_config_path or default_config_dir_of(source),
        trust_remote_code=trust_remote_code,
        is_value_model=is_value_model,
        tie_word_embedding=tie_word_embedding,
    )
    index = load_shards(source, spec)
    lora, adapter = extract_lora(index, spec, merge_lora=merge_lora, lora_alpha=lora_alpha, dtype=dtype)
    plan = merge(index, spec, dtype=dtype, max_shard_size=max_shard_size, lora=lora)
    saved = save(plan, index, spec, target_dir, adapter=adapter, overwrite=overwrite, progress=progress)
    report = validate(saved.target_dir, test_hf_dir, check_logits=check_logits)
    seconds = time.monotonic() - started
    publish_report(index, plan or adapter.weights, report, saved=saved, lora=lora, seconds=seconds)
    if not report.passed:
        raise ValidationError(report.failure_message())

    facts = MergeFacts(
        source=index.checkpoint_dir,
        step=training_step(index.checkpoint_dir),
        backend=backend,
        world_size=index.world_size,
        dtype=saved.dtype,
        merge_seconds=seconds,
        validation=report.verdict(),
        lora=describe_lora(lora) if lora else None,
        base_model=base_model,
    )
    write_card(saved.target_dir, facts)
    if hf_upload_path:
        upload_revision = revision or default_revision(index.checkpoint_dir)
        upload.with_options(
            retries=upload_retries,
            retry_delay_seconds=exponential_backoff(backoff_factor=upload_retry_delay_seconds),
        )(
            saved.target_dir,
            hf_upload_path,
            revision=upload_revision,
            checkpoint_dir=index.checkpoint_dir,
            commit_message=commit_message(index.checkpoint_dir, facts.step),
            private=private,
            token_secret=hf_token_secret,
        )
    return saved


def commit_message(checkpoint_dir: str, step: int | None) -> str:
    source = "/".join(Path(checkpoint_dir).parts[-3:])
    return f"Upload {source} merged by mergeflow" + (f" (training step {step})" if step is not None else "")
