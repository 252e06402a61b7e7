"""Write a merge's weights while its model spec is still being built, and keep what the spec agrees with.

The first merge of a config pays seconds for its spec: transformers and the model's code are imported
and the model is built on the meta device (`mergeflow.spec_build` does it in a child process). A plain
FSDP checkpoint already suggests what the merge most likely writes: its own tensors under their own
names, less the aliases its ranks store once (tied embeddings). An `EarlyWrite` plans that guess and
writes its shards into the staging folder on a background thread, with the resume markers a merge
leaves. Once the spec's plan is made, `settle` lets the shard in progress finish if the plan agrees
with it, stops it if not, and removes every guessed shard the plan does not hold as guessed; the
merge's own write then finds the kept shards finished and writes the rest. The output is what waiting
for the spec writes, and a wrong guess (a model saved under other names) costs only the time the merge
would have spent waiting.
"""

import contextlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path

from mergeflow.errors import MergeflowError, OptionError
from mergeflow.formats.fsdp.index import ShardIndex
from mergeflow.lora import LORA_ONLY_MARKERS
from mergeflow.options import DEFAULT_DTYPE, MAX_SHARD_SIZE
from mergeflow.output.manifest import SavedModel
from mergeflow.output.save import (
    PARTIAL_SUFFIX,
    ShardWriteStopped,
    relocated,
    save_staged,
    shard_marker,
    write_shard,
)
from mergeflow.output.staging import staged_output
from mergeflow.planning import MergePlan, plan_merge
from mergeflow.run_layout import protected_paths
from mergeflow.spec.build import SpecBuild
from mergeflow.spec.config_files import CONFIG_FILE
from mergeflow.spec.model_spec import ModelSpec
from mergeflow.streaming import CHUNK_BYTES

ADAPTER_MARKERS = (*LORA_ONLY_MARKERS, ".modules_to_save.")
"""Names of a LoRA checkpoint, whose plan needs the spec (the adapter's modules come from the model)."""


class EarlyWrite:
    """The shards `guessed_plan` plans for a checkpoint, written into `staging` on a thread until settled."""

    def __init__(
        self, index: ShardIndex | None, guess: MergePlan | None, staging: Path, *, chunk_bytes: int = CHUNK_BYTES
    ):
        self.guess = guess
        self.staging = Path(staging)
        self.finished: list[str] = []
        """Guessed files this write finished (or found finished), in the order written."""
        self._created_staging = False
        self._current: str | None = None
        self._settled = False
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._write, args=(index, chunk_bytes), name="mergeflow-early-write", daemon=True
        )
        if guess is not None:
            self._created_staging = not self.staging.exists()
            self.staging.mkdir(parents=True, exist_ok=True)
            self._thread.start()

    @property
    def writing(self) -> bool:
        """Whether there is a guess to write (the spec was still being built)."""
        return self.guess is not None

    @property
    def settled(self) -> bool:
        return self._settled

    def settle(self, plan: MergePlan | None) -> tuple[str, ...]:
        """Keep the guessed files `plan` holds as guessed (the one in progress is finished, if so) and remove
        the others; return the kept names. With no plan every guessed file goes."""
        with self._lock:
            self._settled = True
            current = self._current
            if current is not None and not (plan is not None and planned_alike(plan, self.guess, current)):
                self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        kept = tuple(name for name in self.finished if plan is not None and planned_alike(plan, self.guess, name))
        for name in self.finished:
            if name not in kept:
                (self.staging / name).unlink(missing_ok=True)
                shard_marker(self.staging, name).unlink(missing_ok=True)
        if self._created_staging and plan is None:
            with contextlib.suppress(OSError):
                self.staging.rmdir()
        return kept

    def _write(self, index: ShardIndex, chunk_bytes: int) -> None:
        for filename in self.guess.shard_to_names:
            with self._lock:
                if self._settled:
                    return
                self._current = filename
            try:
                write_shard(self.guess, index, self.staging, filename, chunk_bytes=chunk_bytes, stop=self._stop)
            except ShardWriteStopped:
                return
            except Exception:  # the merge's own write meets the same problem and reports it
                (self.staging / f"{filename}{PARTIAL_SUFFIX}").unlink(missing_ok=True)
                return
            finally:
                with self._lock:
                    self._current = None
            self.finished.append(filename)


@contextlib.contextmanager
def early_write(
    index: ShardIndex | None,
    build: SpecBuild | None,
    staging: Path,
    *,
    dtype: str = DEFAULT_DTYPE,
    max_shard_size: int | str = MAX_SHARD_SIZE,
    chunk_bytes: int = CHUNK_BYTES,
) -> Iterator[EarlyWrite]:
    """Write `index`'s guessed shards into `staging` while `build` runs; nothing is written without a build
    still running, without an index (a Megatron archive maps its names through the spec), for LoRA
    adapters, or for custom code not allowed to run. The block must `settle` the write; a block that
    raises removes what it wrote.

    A read-ahead of the checkpoint should end before it is indexed (`stop_read_ahead`): its queued reads
    would delay the index's and the write's own.
    """
    guess = None
    if index is not None and build is not None and not build.done() and not may_be_refused(build):
        guess = guessed_plan(index, build.config_dir, dtype, max_shard_size)
    early = EarlyWrite(index, guess, staging, chunk_bytes=chunk_bytes)
    try:
        yield early
    finally:
        if not early.settled:
            early.settle(None)


def may_be_refused(build: SpecBuild) -> bool:
    """Whether config.json names custom code (`auto_map`) that the merge may not run: the spec lookup is
    likely to refuse it, and nothing should be written first."""
    if build.trust_remote_code:
        return False
    try:
        return "auto_map" in json.loads((build.config_dir / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return True


def checkpoint_guess(index: ShardIndex, config_dir: Path) -> ModelSpec:
    """The spec as the checkpoint alone suggests it: every tensor it holds, its stored-once aliases tied."""
    shapes = {name: tensor.shape for name, tensor in index.tensors.items() if name not in index.aliases}
    return ModelSpec(
        config_dir=str(config_dir),
        architecture="",
        model_class="",
        trust_remote_code=False,
        expected_shapes=shapes,
        saved_shapes=shapes,
        saved_views={},
        tied=dict(index.aliases),
        is_value_model=False,
    )


def guessed_plan(index: ShardIndex, config_dir: Path, dtype: str, max_shard_size: int | str) -> MergePlan | None:
    """The plan of `checkpoint_guess`, or None where only the spec can plan the checkpoint (LoRA adapters,
    or a checkpoint the guess cannot plan)."""
    if holds_adapters(index):
        return None
    try:
        return plan_merge(index, checkpoint_guess(index, config_dir), dtype=dtype, max_shard_size=max_shard_size)
    except MergeflowError:
        return None


def holds_adapters(index: ShardIndex) -> bool:
    return any(marker in name for name in index.tensors for marker in ADAPTER_MARKERS)


def planned_alike(plan: MergePlan, guessed: MergePlan, filename: str) -> bool:
    """Whether both plans put the same tensors, stored the same way, in output file `filename`."""
    names = plan.shard_to_names.get(filename)
    return names == guessed.shard_to_names.get(filename) and all(
        plan.tensors[name] == guessed.tensors[name] for name in names or ()
    )


def save_model_early(
    index: ShardIndex,
    build: SpecBuild,
    target_dir: Path,
    *,
    dtype: str = DEFAULT_DTYPE,
    max_shard_size: int | str = MAX_SHARD_SIZE,
    tie_word_embedding: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    chunk_bytes: int = CHUNK_BYTES,
) -> tuple[SavedModel, tuple[str, ...]]:
    """Merge an FSDP checkpoint without LoRA into `target_dir` as `save_model` does with the spec `build`
    gives, writing while it builds; also return the output files written before the spec was known.

    Raises what `load_model_spec`, `plan_merge` and `save_model` raise; the target is left as it was.
    """
    if holds_adapters(index):
        raise OptionError(
            f"checkpoint {index.checkpoint_dir} holds LoRA adapters, which save_model_early does not plan: "
            "plan them with mergeflow.lora.plan_lora and save with mergeflow.output.save.save_model"
        )
    target_dir = Path(target_dir).absolute()
    protected = protected_paths(index.checkpoint_dir, build.config_dir)
    with staged_output(target_dir, overwrite=overwrite, protected=protected) as staging:
        with early_write(index, build, staging, dtype=dtype, max_shard_size=max_shard_size, chunk_bytes=chunk_bytes) as early:
            spec = build.spec(tie_word_embedding=tie_word_embedding)
            plan = plan_merge(index, spec, dtype=dtype, max_shard_size=max_shard_size)
            kept = early.settle(plan)
        saved = save_staged(plan, index, spec, staging, target_dir, progress=progress, chunk_bytes=chunk_bytes)
    return relocated(saved, target_dir), kept
