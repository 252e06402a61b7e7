"""The merge pipeline: fingerprint, then (once per fingerprint) world size, config, shards, LoRA, plan, the
shards written as their own task runs, validation, model card and publication; then the upload.

While a config not seen before is read, an FSDP checkpoint's shards are already being written as the
checkpoint alone suggests (`mergeflow.early_write`); the shard mergeflow.tasks keep those the plan agrees with."""

import dataclasses
import shutil
import time
from dataclasses import asdict
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.tasks import exponential_backoff

from mergeflow.early_write import EarlyWrite, early_write
from mergeflow.errors import MergeflowError, ValidationError
from mergeflow.fingerprint import MergeKey
from mergeflow.formats.fsdp.index import index_shards
from mergeflow.formats.fsdp.layout import RankFiles
from mergeflow.formats.megatron.layout import MegatronLayout
from mergeflow.hub import check_repo_id, default_revision, training_step
from mergeflow.lora import LoraPlan, describe_lora
from mergeflow.options import DEFAULT_DTYPE, MAX_SHARD_SIZE, MergeOptions, check_backend
from mergeflow.output.manifest import SavedModel, output_intact
from mergeflow.output.model_card import MergeFacts
from mergeflow.output.save import relocated
from mergeflow.output.staging import check_target, resumable_staging, staging_dir_of
from mergeflow.perf.read_ahead import read_ahead, stop_read_ahead
from mergeflow.planning import MergePlan
from mergeflow.preflight import config_dir_of
from mergeflow.run_layout import label_of, protected_paths
from mergeflow.spec.build import SpecBuild
from mergeflow.tasks.cache import MERGE_CACHE, recorded_merge
from mergeflow.tasks.copy_model import copy_model
from mergeflow.tasks.detect_world_size import detect_world_size
from mergeflow.tasks.extract_lora import extract_lora
from mergeflow.tasks.fingerprint import fingerprint
from mergeflow.tasks.load_config import load_config
from mergeflow.tasks.load_shards import load_shards
from mergeflow.tasks.merge import merge
from mergeflow.tasks.publish import publish
from mergeflow.tasks.publish_report import publish_report
from mergeflow.tasks.save import save
from mergeflow.tasks.upload import UPLOAD_RETRIES, UPLOAD_RETRY_DELAY_SECONDS, upload
from mergeflow.tasks.validate import validate
from mergeflow.tasks.write_model_card import write_card
from mergeflow.validation.validate import ValidationReport

SHARD_WORKERS = 2
"""Output shards written at once by the default (thread pool) task runner."""


def merge_run_name() -> str:
    """`merge run-a/step-120/actor` in the Prefect UI."""
    return f"merge {label_of(flow_run.parameters['local_dir'])}"


@task(
    name="merge-model",
    cache_policy=MERGE_CACHE,
    persist_result=True,
    result_serializer="json",
    task_run_name="merge-model-{key.digest:.12}",
)
def merge_model(
    key: MergeKey,
    local_dir: str,
    target_dir: str,
    options: MergeOptions,
    *,
    overwrite: bool = False,
    test_hf_dir: str | None = None,
    check_logits: bool = False,
    progress: bool = True,
) -> SavedModel:
    """Build the validated model folder beside the target and rename it into place; cached by `key`.

    The target is checked first, under the merge's lock. The cached value is the output manifest. The
    staging directory is named by the key, so a run of the same merge after a crash keeps the shards
    already written.
    """
    started = time.monotonic()
    source = detect_world_size(local_dir, options.backend)
    protected = protected_paths(local_dir, config_dir_of(source, options.hf_model_config_path))
    check_target(Path(target_dir), overwrite=overwrite, protected=protected)
    if isinstance(source, MegatronLayout) and source.hf_weights:
        staging = resumable_staging(Path(target_dir), key.digest)
        staged = copy_model(source.hf_dir, str(staging))
        report = validate(staged.target_dir, test_hf_dir, check_logits=check_logits, target_dir=target_dir)
        check_report(report, staging)
        facts = merge_facts(source.checkpoint_dir, source.world_size, staged, report, options, started)
        write_card(staged.target_dir, facts)
        return publish(validated(staged, report), target_dir, overwrite=overwrite, protected=protected)
    staging = staging_dir_of(Path(target_dir), key.digest)
    with writing_early(source, local_dir, staging, options) as early:
        with read_ahead(source.data_files, start=not early.writing):  # the disk is idle while a spec builds
            spec = load_config(
                local_dir,
                str(config_dir_of(source, options.hf_model_config_path)),
                trust_remote_code=options.trust_remote_code,
                is_value_model=options.is_value_model,
                tie_word_embedding=options.tie_word_embedding,
            )
        index = load_shards(source, spec)
        lora, adapter = extract_lora(
            index, spec, merge_lora=options.merge_lora, lora_alpha=options.lora_alpha, dtype=options.dtype
        )
        plan = merge(index, spec, dtype=options.dtype, max_shard_size=options.max_shard_size, lora=lora)
        report_early_write(early, plan)
    staging = resumable_staging(Path(target_dir), key.digest)
    staged = save(plan, index, spec, str(staging), target_dir, adapter=adapter, progress=progress)
    report = validate(staged.target_dir, test_hf_dir, check_logits=check_logits, target_dir=target_dir)
    seconds = time.monotonic() - started
    publish_report(index, plan or adapter.weights, report, saved=relocated(staged, Path(target_dir).absolute()), lora=lora, seconds=seconds)
    check_report(report, staging)
    facts = merge_facts(index.checkpoint_dir, index.world_size, staged, report, options, started, lora=lora)
    write_card(staged.target_dir, facts)
    return publish(validated(staged, report), target_dir, overwrite=overwrite, protected=protected)


def writing_early(source: RankFiles | MegatronLayout, local_dir: str, staging: Path, options: MergeOptions):
    """An FSDP checkpoint whose config has not been seen has its shards written while the spec is built
    (`mergeflow.early_write`), and any read-ahead of its files ends first; a cached spec, a Megatron
    archive or LoRA adapters write nothing early."""
    if not isinstance(source, RankFiles):
        return early_write(None, None, staging)
    config_dir = config_dir_of(source, options.hf_model_config_path)
    try:
        build = SpecBuild(
            config_dir, trust_remote_code=options.trust_remote_code, is_value_model=options.is_value_model
        )
        if build.done():
            return early_write(None, None, staging)
        stop_read_ahead(source.data_files)
        index = index_shards(source)
    except (OSError, MergeflowError):  # load-config and load-shards meet the same problem and report it
        return early_write(None, None, staging)
    return early_write(index, build, staging, dtype=options.dtype, max_shard_size=options.max_shard_size)


def report_early_write(early: EarlyWrite, plan: MergePlan | None) -> None:
    """Settle the early write against the plan and say what it kept."""
    kept = early.settle(plan)
    if early.writing:
        get_run_logger().info(
            "%d of %d weight file(s) written while the model config was read hold what its plan asks for: kept",
            len(kept),
            len(early.guess.shard_to_names),
        )


def check_report(report: ValidationReport, staging: Path) -> None:
    """A folder that fails validation is never published: its staging directory goes too."""
    if not report.passed:
        shutil.rmtree(staging, ignore_errors=True)
        raise ValidationError(report.failure_message())


def validated(staged: SavedModel, report: ValidationReport) -> SavedModel:
    return dataclasses.replace(staged, validation=report.verdict())


def merge_facts(
    checkpoint_dir: str,
    world_size: int,
    staged: SavedModel,
    report: ValidationReport,
    options: MergeOptions,
    started: float,
    *,
    lora: LoraPlan | None = None,
) -> MergeFacts:
    return MergeFacts(
        source=checkpoint_dir,
        step=training_step(checkpoint_dir),
        backend=options.backend,
        world_size=world_size,
        dtype=staged.dtype,
        merge_seconds=time.monotonic() - started,
        validation=report.verdict(),
        lora=describe_lora(lora) if lora else None,
        base_model=options.base_model,
    )


@flow(
    name="merge-checkpoint",
    flow_run_name=merge_run_name,
    task_runner=ThreadPoolTaskRunner(max_workers=SHARD_WORKERS),
)
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
    refresh_cache: bool = False,
    progress: bool = True,
) -> SavedModel:
    """Merge a verl checkpoint directory (`global_step_N/actor`) into a validated Hugging Face model folder.

    A merge whose inputs (by path, size and mtime), options, target and engine version are unchanged, and
    whose output is still in place, is a cache hit: nothing is read or written (`refresh_cache` forces a
    new merge). A LoRA checkpoint gives the base model plus `lora_adapter/`, or with `merge_lora` the base
    model with the LoRA folded in. With `hf_upload_path` the validated model is uploaded to the Hub, on
    `revision` (default: a branch per training step, `step-N`); the token comes from HF_TOKEN, the
    huggingface_hub login, or the Prefect Secret block named by `hf_token_secret`.
    """
    check_backend(backend)
    if hf_upload_path:
        check_repo_id(hf_upload_path)
    options = MergeOptions(
        backend=backend,
        dtype=dtype,
        max_shard_size=max_shard_size,
        hf_model_config_path=hf_model_config_path,
        trust_remote_code=trust_remote_code,
        is_value_model=is_value_model,
        tie_word_embedding=tie_word_embedding,
        merge_lora=merge_lora,
        lora_alpha=lora_alpha,
        base_model=base_model,
    )
    key = fingerprint(local_dir, target_dir, asdict(options))
    previous = recorded_merge(merge_model, key.digest)
    reusable = previous is not None and not refresh_cache and output_intact(previous)
    state = merge_model.with_options(refresh_cache=not reusable and (previous is not None or refresh_cache))(
        key,
        local_dir,
        target_dir,
        options,
        overwrite=overwrite or previous is not None,
        test_hf_dir=test_hf_dir,
        check_logits=check_logits,
        progress=progress,
        return_state=True,
    )
    saved = state.result()
    if state.is_completed() and state.name == "Cached":
        get_run_logger().info(
            "cache hit: %s already holds this merge, validated when it was written", target_dir
        )
        if test_hf_dir:
            report = validate(saved.target_dir, test_hf_dir, check_logits=check_logits)
            if not report.passed:
                raise ValidationError(report.failure_message())
    if hf_upload_path:
        upload_merged(
            saved,
            local_dir,
            hf_upload_path,
            revision,
            private=private,
            token_secret=hf_token_secret,
            retries=upload_retries,
            retry_delay_seconds=upload_retry_delay_seconds,
        )
    return saved


def upload_merged(
    saved: SavedModel,
    local_dir: str,
    repo_id: str,
    revision: str | None,
    *,
    private: bool,
    token_secret: str | None,
    retries: int,
    retry_delay_seconds: float,
) -> None:
    checkpoint_dir = str(Path(local_dir).absolute())
    upload.with_options(
        retries=retries, retry_delay_seconds=exponential_backoff(backoff_factor=retry_delay_seconds)
    )(
        saved.target_dir,
        repo_id,
        revision=revision or default_revision(checkpoint_dir),
        checkpoint_dir=checkpoint_dir,
        commit_message=commit_message(checkpoint_dir, training_step(checkpoint_dir)),
        private=private,
        token_secret=token_secret,
    )


def commit_message(checkpoint_dir: str, step: int | None) -> str:
    source = "/".join(Path(checkpoint_dir).parts[-3:])
    return f"Upload {source} merged by mergeflow" + (f" (training step {step})" if step is not None else "")
