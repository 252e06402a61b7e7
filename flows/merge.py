"""The merge pipeline: world size, config, shards, merge, save, validate, report."""

import time
from pathlib import Path

from prefect import flow

from mergeflow.errors import OptionError, ValidationError
from mergeflow.output import check_target
from mergeflow.planning import DEFAULT_DTYPE, MAX_SHARD_SIZE
from mergeflow.save import SavedModel
from tasks.detect_world_size import detect_world_size
from tasks.extract_lora import extract_lora
from tasks.load_config import load_config
from tasks.load_shards import load_shards
from tasks.merge import merge
from tasks.publish_report import publish_report
from tasks.save import save
from tasks.validate import validate

BACKENDS = ("fsdp",)


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
    progress: bool = True,
) -> SavedModel:
    """Merge a verl checkpoint directory (`global_step_N/actor`) into a validated Hugging Face model folder.

    A LoRA checkpoint gives the base model plus `lora_adapter/`, or with `merge_lora` the base model
    with the LoRA folded in.
    """
    started = time.monotonic()
    check_backend(backend)
    check_target(Path(target_dir), overwrite=overwrite)

    rank_files = detect_world_size(local_dir)
    spec = load_config(
        local_dir,
        hf_model_config_path,
        trust_remote_code=trust_remote_code,
        is_value_model=is_value_model,
        tie_word_embedding=tie_word_embedding,
    )
    index = load_shards(rank_files)
    lora, adapter = extract_lora(index, spec, merge_lora=merge_lora, lora_alpha=lora_alpha, dtype=dtype)
    plan = merge(index, spec, dtype=dtype, max_shard_size=max_shard_size, lora=lora)
    saved = save(plan, index, spec, target_dir, adapter=adapter, overwrite=overwrite, progress=progress)
    report = validate(saved.target_dir, test_hf_dir, check_logits=check_logits)
    publish_report(
        index, plan or adapter.weights, report, saved=saved, lora=lora, seconds=time.monotonic() - started
    )

    if not report.passed:
        raise ValidationError(report.failure_message())
    return saved
