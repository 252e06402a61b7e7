"""One merge of one verl checkpoint into one model folder.

The pipeline's steps are methods that return small manifests (the flow's tasks pass these on, so Prefect
draws the graph); the state the steps share (the spec, the index with its mapped rank files, the plan)
stays in this object, built when first needed. What speeds a merge up from outside (reading ahead, writing
the weight files ahead while Prefect starts) is `mergeflow.write_ahead`. Imports no torch until a step needs it.
"""

import dataclasses
import functools
import math
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mergeflow.fingerprint import MergeKey, merge_key
from mergeflow.formats.base import Layout
from mergeflow.formats.registry import backend_named, find_checkpoint
from mergeflow.options import MergeOptions, Reference
from mergeflow.output.staging import staging_dir_of
from mergeflow.output.streaming import CHUNK_BYTES
from mergeflow.perf import timeline
from mergeflow.perf.read_ahead import ReadAhead, whole_files
from mergeflow.run_layout import protected_paths
from mergeflow.spec import cache as spec_cache

if TYPE_CHECKING:
    from mergeflow.formats.base import TensorIndex
    from mergeflow.lora import LoraPlan
    from mergeflow.output.manifest import SavedModel, ShardWritten
    from mergeflow.planning import AdapterPlan, MergePlan
    from mergeflow.spec.model_spec import ModelSpec
    from mergeflow.validation.report import ValidationReport


@dataclass(frozen=True)
class CheckpointFound:
    """What `find_checkpoint` found."""

    checkpoint_dir: str
    backend: str
    world_size: int
    data_files: int
    config_dir: str
    model_dir: str | None
    """A folder that already holds the Hugging Face model (an mbridge run): it is copied, not merged."""


@dataclass(frozen=True)
class ConfigLoaded:
    """What the Hugging Face config says the merged model holds."""

    config_dir: str
    model_class: str
    tensors: int
    tied: dict[str, str]


@dataclass(frozen=True)
class ShardsLoaded:
    """The checkpoint's tensors, and how they were saved (mesh, tensor parallelism)."""

    tensors: int
    facts: dict[str, Any]


@dataclass(frozen=True)
class LoraFound:
    """The LoRA adapter the checkpoint holds, if any, and what is done with it."""

    description: str | None
    """None for a checkpoint without LoRA."""
    notes: tuple[str, ...] = ()
    folds: int = 0


@dataclass(frozen=True)
class PlanMade:
    """Where every tensor of the merged model goes."""

    weight_files: dict[str, int]
    """Each weight file of the model, with the bytes of tensors it holds (none for a LoRA-only checkpoint,
    which gives an adapter alone)."""
    tensors: int
    total_size: int
    dtype: str
    dropped_aliases: dict[str, str]
    unexpected: tuple[str, ...]
    parameters: int
    """Elements of every tensor written (the adapter's, for a LoRA-only checkpoint)."""


@dataclass(frozen=True)
class MergeSteps:
    """What the steps before the weights found, together (what `flows.prepare` returns)."""

    config: ConfigLoaded
    shards: ShardsLoaded
    lora: LoraFound
    plan: PlanMade


class MergeJob:
    """One merge: the steps of the pipeline, with the state they share and the machinery that speeds them up.

    Pickled (for a Dask or Ray worker), it carries its inputs only, by absolute paths; the worker builds what its
    step needs.
    """

    def __init__(
        self,
        local_dir: str | Path,
        target_dir: str | Path | None,
        options: MergeOptions | None = None,
        *,
        chunk_bytes: int = CHUNK_BYTES,
    ):
        self.local_dir = str(Path(local_dir).absolute())
        self.target_dir = str(Path(target_dir).absolute()) if target_dir is not None else None
        """None for a job that writes nothing (`mergeflow test` compares in place)."""
        self.options = (options or MergeOptions()).with_absolute_paths()
        self.chunk_bytes = chunk_bytes
        """The largest block of rows read and written at once: it bounds the merge's memory."""
        self._state_lock = threading.RLock()
        self._key: MergeKey | None = None
        self._layout: Layout | None = None
        self._spec: ModelSpec | None = None
        self._spec_guessed = False
        self._index: TensorIndex | None = None
        self._lora: tuple[LoraPlan | None] | None = None
        self._plan: tuple[MergePlan | None, AdapterPlan | None] | None = None
        self._read_ahead: ReadAhead | None = None
        self.started = time.monotonic()

    def __reduce__(self):
        return functools.partial(MergeJob, chunk_bytes=self.chunk_bytes), (self.local_dir, self.target_dir, self.options)

    # --- the steps

    def key(self) -> MergeKey:
        """The merge's identity: the checkpoint's files (and an outside config's) by size and mtime, the
        options, the target and the engine version."""
        with self._state_lock:
            if self._key is None:
                inputs = [Path(self.local_dir)]
                config = self.options.hf_model_config_path
                if config and not Path(config).absolute().is_relative_to(Path(self.local_dir).absolute()):
                    inputs.append(Path(config))
                self._key = merge_key(inputs, Path(self.target_dir or ""), dataclasses.asdict(self.options))
            return self._key

    @property
    def staging_dir(self) -> Path:
        """Where the model is built before it is renamed into place (named by the key, so a merge killed part
        way resumes in it)."""
        return staging_dir_of(Path(self.target_dir), self.key().digest)

    def find_checkpoint(self) -> CheckpointFound:
        layout = self.layout()
        return CheckpointFound(
            checkpoint_dir=layout.checkpoint_dir,
            backend=self.options.backend,
            world_size=layout.world_size,
            data_files=len(layout.data_files),
            config_dir=str(self.config_dir()),
            model_dir=layout.model_dir,
        )

    def load_config(self) -> ConfigLoaded:
        """The model spec (while a spec not seen before is built, the checkpoint is read ahead)."""
        spec = self.spec()
        return ConfigLoaded(str(self.config_dir()), spec.model_class, len(spec.expected_shapes), dict(spec.tied))

    def load_shards(self) -> ShardsLoaded:
        index = self.index()
        return ShardsLoaded(len(index.tensors), index.facts())

    def extract_lora(self) -> LoraFound:
        from mergeflow.lora import describe_lora

        lora = self.lora()
        if lora is None:
            return LoraFound(None)
        return LoraFound(describe_lora(lora), lora.notes, len(lora.folds))

    def plan(self, *, replace: bool = False) -> PlanMade:
        """Plan every output tensor and file, once the target is known to be writable (`replace`: it may
        hold an earlier output, of this merge or, with --overwrite, another folder)."""
        from mergeflow.output.staging import check_target

        if self.target_dir is not None:
            check_target(Path(self.target_dir), overwrite=replace, protected=self.protected())
        plan, adapter = self.merge_plan()
        if self.target_dir is not None:
            self.staging_dir.mkdir(parents=True, exist_ok=True)
        weights = plan if plan is not None else adapter.weights
        return PlanMade(
            weight_files={
                filename: sum(plan.tensors[name].nbytes for name in names) for filename, names in plan.shard_to_names.items()
            }
            if plan is not None
            else {},
            tensors=len(weights.tensors),
            total_size=weights.total_size,
            dtype=weights.config_dtype,
            dropped_aliases=dict(plan.dropped_aliases) if plan is not None else {},
            unexpected=tuple(plan.unexpected) if plan is not None else (),
            parameters=sum(math.prod(tensor.shape) for tensor in weights.tensors.values()),
        )

    def write_shard(self, filename: str, *, on_bytes=None, written_ahead_for: int | None = None) -> "ShardWritten":
        """Write (or keep, when it is already there as planned) one weight file in the staging folder
        (`written_ahead_for`: the command whose write-ahead child this is)."""
        from mergeflow.output.save import write_shard

        plan, _ = self.merge_plan()
        with timeline.span(f"write {filename}"):
            return write_shard(
                plan,
                self.index(),
                self.staging_dir,
                filename,
                chunk_bytes=self.chunk_bytes,
                on_bytes=on_bytes,
                written_ahead_for=written_ahead_for,
            )

    def save(self, shards: "list[ShardWritten]") -> "SavedModel":
        """Write the rest of the model folder (weight index, config, generation config, tokenizer and other
        files, the LoRA adapter) beside the weight files; return the staging folder's manifest."""
        from mergeflow.output.save import describe_output, write_model_files

        plan, adapter = self.merge_plan()
        self.staging_dir.mkdir(parents=True, exist_ok=True)
        write_model_files(
            plan,
            self.index(),
            self.spec(),
            self.staging_dir,
            adapter=adapter,
            base_model=self.options.base_model,
        )
        return describe_output(plan, adapter, self.staging_dir, shards, seconds=time.monotonic() - self.started)

    def copy_model(self, *, replace: bool = False) -> "SavedModel":
        """Copy a checkpoint's ready Hugging Face folder into the staging folder, byte for byte."""
        from mergeflow.output.copy import copy_model_folder
        from mergeflow.output.staging import check_target

        check_target(Path(self.target_dir), overwrite=replace, protected=self.protected())
        self.staging_dir.mkdir(parents=True, exist_ok=True)
        return copy_model_folder(Path(self.layout().model_dir), self.staging_dir, config_dir=self.config_dir())

    def validate(self, saved: "SavedModel", reference: Reference | None = None) -> "ValidationReport":
        """Check the saved folder is complete and, given a reference, equal to it."""
        from mergeflow.validation.validate import reference_arguments, validate_model_dir

        return validate_model_dir(
            Path(saved.folder),
            **reference_arguments(reference),
            shown_as=self.target_dir,
            fp8_errors=saved.fp8_errors,
            fp8_outside=saved.fp8_outside,
            mtp_dropped=self.options.drop_mtp,
        )

    def compare(
        self, reference: Reference, *, weight_file: str | None = None, key_sets_only: bool = False
    ) -> "ValidationReport":
        """Compare the merged tensors, read straight from the checkpoint, with a reference (nothing is written): all
        of them, the values of those `weight_file` would hold, or the key sets alone (`validate.combined` joins the
        parts).

        Raises:
            OptionError: a LoRA-only checkpoint, which holds no base model to compare.
        """
        from mergeflow.errors import OptionError
        from mergeflow.planning import mtp_layer_names
        from mergeflow.validation.merged_view import MergedCheckpoint
        from mergeflow.validation.validate import compare_to_reference

        plan, _ = self.merge_plan()
        if plan is None:
            raise OptionError(f"{self.local_dir} is a LoRA-only checkpoint: it holds no base model to compare")
        values_of = None  # every tensor's values, and the key sets
        if key_sets_only:
            values_of = frozenset()
        elif weight_file:
            values_of = frozenset(plan.shard_to_names[weight_file])
        with MergedCheckpoint(plan, self.index()) as merged:
            report = compare_to_reference(
                merged,
                Path(reference.test_hf_dir),
                model_dir=self.layout().checkpoint_dir,
                tied=self.spec().tied,
                transposed=self.spec().transposed_on_disk,
                left_out=(lambda names: mtp_layer_names(names, self.spec())) if self.options.drop_mtp else None,
                atol=reference.atol,
                rtol=reference.rtol,
                values_of=values_of,
            )
            merged.verify()
        return report

    def write_model_card(
        self, saved: "SavedModel", report: "ValidationReport", checkpoint: CheckpointFound, lora: "LoraFound | None"
    ) -> str | None:
        """README.md with the merge's facts, unless the checkpoint brought its own model card."""
        from mergeflow.fp8 import FP8_DESCRIPTION
        from mergeflow.hub import training_step
        from mergeflow.output.model_card import MergeFacts, write_model_card

        facts = MergeFacts(
            source=checkpoint.checkpoint_dir,
            step=training_step(self.local_dir),
            backend=checkpoint.backend,
            world_size=checkpoint.world_size,
            dtype=saved.dtype,
            merge_seconds=time.monotonic() - self.started,
            validation=report.verdict(),
            lora=lora.description if lora is not None else None,
            base_model=self.options.base_model,
            quantization=FP8_DESCRIPTION if self.options.quantize == "fp8" else None,
        )
        path = write_model_card(Path(saved.folder), facts)
        return str(path) if path is not None else None

    def publish(self, saved: "SavedModel", report: "ValidationReport", *, replace: bool = False) -> "SavedModel":
        """Rename the validated staging folder into place as the target; return the target's manifest.

        Raises:
            ValidationError: the folder failed validation (it is not published, and the staging folder goes).
        """
        from mergeflow.errors import ValidationError
        from mergeflow.output.manifest import describe_files
        from mergeflow.output.save import relocated
        from mergeflow.output.staging import publish

        if not report.passed:
            shutil.rmtree(self.staging_dir, ignore_errors=True)
            raise ValidationError(report.failure_message())
        described = dataclasses.replace(saved, files=describe_files(self.staging_dir), validation=report.verdict())
        publish(self.staging_dir, Path(self.target_dir), overwrite=replace, protected=self.protected())
        return relocated(described, Path(self.target_dir))

    def run(self, *, overwrite: bool = False) -> "SavedModel":
        """The whole merge without Prefect (the engine run of the bench and the tests): the weight files and
        the rest (or a ready model's copy) into the staging folder, renamed into place (no validation, no model
        card). A failure removes the staging folder and leaves the target as it was."""
        from mergeflow.output.save import relocated
        from mergeflow.output.staging import publish

        try:
            if self.layout().model_dir is not None:
                saved = self.copy_model(replace=overwrite)
            else:
                plan = self.plan(replace=overwrite)
                saved = self.save([self.write_shard(filename) for filename in plan.weight_files])
            publish(self.staging_dir, Path(self.target_dir), overwrite=overwrite, protected=self.protected())
        except BaseException:
            shutil.rmtree(self.staging_dir, ignore_errors=True)
            raise
        return relocated(saved, Path(self.target_dir))

    # --- the state the steps share, built when first needed

    def layout(self) -> Layout:
        with self._state_lock:
            if self._layout is None:
                self._layout = find_checkpoint(self.local_dir, self.options.backend)
            return self._layout

    def config_dir(self) -> Path:
        return Path(self.options.hf_model_config_path or self.layout().config_dir)

    def protected(self):
        """The directories of the training run that the target may not overlap."""
        return protected_paths(self.local_dir, self.config_dir())

    def spec(self) -> "ModelSpec":
        from mergeflow.spec.model_spec import load_model_spec

        with self._state_lock:
            if self._spec is None:
                if not self.spec_stored():
                    self.start_read_ahead(self.layout().data_files)
                self._spec = load_model_spec(
                    self.config_dir(), tie_word_embedding=self.options.tie_word_embedding, **self.spec_options()
                )
            return self._spec

    def guess_spec(self) -> bool:
        """Plan with a spec guessed from the checkpoint itself (`spec.guess`) while the real one, not stored yet, is
        built elsewhere: the write-ahead child's way to write the weight files meanwhile (the flow's steps plan with
        the real spec). Returns whether it guessed (not for a backend whose index needs the spec)."""
        from mergeflow.spec.guess import guessed_spec

        with self._state_lock:
            if self._spec is not None or backend_named(self.options.backend).needs_spec or self.spec_stored():
                return False
            index = self.index()
            shapes = {name: tuple(tensor.shape) for name, tensor in index.tensors.items()}
            self._spec = guessed_spec(self.config_dir(), shapes, index.aliases, **self.spec_options())
            self._spec_guessed = True
            return True

    def replan_with_stored_spec(self) -> bool:
        """Once the real spec is stored, forget a guessed one and what was planned with it; returns whether it did."""
        with self._state_lock:
            if not self._spec_guessed or not self.spec_stored():
                return False
            self._spec = self._lora = self._plan = None
            self._spec_guessed = False
            return True

    def index(self) -> "TensorIndex":
        with self._state_lock:
            if self._index is None:
                spec = self.spec() if backend_named(self.options.backend).needs_spec else None
                self._index = self.layout().index(spec)
            return self._index

    def lora(self) -> "LoraPlan | None":
        from mergeflow.lora import plan_lora

        with self._state_lock:
            if self._lora is None:
                lora = plan_lora(
                    self.index(), self.spec(), merge=self.options.merge_lora, lora_alpha=self.options.lora_alpha
                )
                self._lora = (lora,)
            return self._lora[0]

    def merge_plan(self) -> "tuple[MergePlan | None, AdapterPlan | None]":
        """The model's plan (None for a LoRA-only checkpoint) and the adapter's (None without one to write)."""
        from mergeflow.planning import plan_adapter, plan_merge

        with self._state_lock:
            if self._plan is None:
                lora, options = self.lora(), self.options
                adapter = plan_adapter(self.index(), lora, dtype=options.dtype) if lora and not lora.merge else None
                plan = None
                if lora is None or not lora.lora_only:
                    plan = plan_merge(
                        self.index(),
                        self.spec(),
                        dtype=options.dtype,
                        max_shard_size=options.max_shard_size,
                        lora=lora,
                        quantize=options.quantize,
                        drop_mtp=options.drop_mtp,
                    )
                self._plan = (plan, adapter)
                self._read_ahead_in_plan_order(plan)
            return self._plan

    def spec_stored(self) -> bool:
        """Whether this job's model spec is in the spec cache (looked up, nothing built)."""
        return spec_cache.is_stored(spec_cache.model_spec_key(self.config_dir(), **self.spec_options()))

    def spec_options(self) -> dict[str, bool]:
        return {"trust_remote_code": self.options.trust_remote_code, "is_value_model": self.options.is_value_model}

    def start_read_ahead(self, paths: tuple[str, ...]) -> None:
        """Read `paths` ahead (their zip metadata first, which indexing reads) until this job's plan is made; again
        if it had ended while a new spec is built."""
        if self._read_ahead is None:
            self._read_ahead = ReadAhead(whole_files(paths))
        if not self._read_ahead.running:
            self._read_ahead.start()
            timeline.mark("read-ahead started")

    def _read_ahead_in_plan_order(self, plan: "MergePlan | None") -> None:
        """Once planned, a read-ahead still running goes on over the tensors' bytes in the order the weight files
        are written (where the checkpoint's index says where they lie), instead of file by file."""
        from mergeflow.output.save import sources_in_write_order

        running = self._read_ahead is not None and self._read_ahead.running
        self._stop_read_ahead()
        ranges = getattr(self._index, "byte_ranges", None)
        if running and plan is not None and ranges is not None:
            self._read_ahead = ReadAhead(ranges(sources_in_write_order(plan))).start()
            timeline.mark("read-ahead in plan order")

    def _stop_read_ahead(self) -> None:
        if self._read_ahead is not None:
            if self._read_ahead.running:
                timeline.mark("read-ahead stopped")
            self._read_ahead.stop()

    def close(self) -> None:
        self._stop_read_ahead()
