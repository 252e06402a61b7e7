"""Execute a merge plan: stream every tensor into safetensors files and write the model folder atomically."""

import contextlib
import copy
import dataclasses
import fcntl
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from tqdm.auto import tqdm

from mergeflow.dtypes import parse_dtype_name
from mergeflow.formats.base import TensorIndex
from mergeflow.options import is_hub_model_id
from mergeflow.output.manifest import SavedModel, ShardWritten, describe_files
from mergeflow.output.materialize import PlannedTensors
from mergeflow.output.model_files import copy_side_files, write_config, write_generation_config
from mergeflow.output.shard_locks import LOCK_SUFFIX, closed_to_writers, file_lock
from mergeflow.output.streaming import CHUNK_BYTES, prefetched
from mergeflow.output.writer import SafetensorsWriter, TensorEntry, build_header
from mergeflow.planning import AdapterPlan, MergePlan, OutputTensor
from mergeflow.spec.config_files import CONFIG_FILE, WEIGHT_INDEX_FILE
from mergeflow.spec.model_spec import ModelSpec
from mergeflow.spec.peft_names import ADAPTER_SUBDIR

DONE_SUFFIX = ".done"
SAFETENSORS_SUFFIX = ".safetensors"
PARTIAL_SUFFIX = ".partial"


def write_model_files(
    plan: MergePlan | None,
    index: TensorIndex,
    spec: ModelSpec,
    staging: Path,
    *,
    adapter: AdapterPlan | None = None,
    base_model: str | None = None,
    progress: bool = True,
) -> None:
    """Everything but the weight shards: their index, config, generation config, side files, the adapter (which
    names `base_model` or the Hub model the config was saved from; an adapter alone also carries the tokenizer and
    chat template, as adapter repos do)."""
    if plan is not None:
        write_weight_index(plan, staging)
        write_config(spec, staging, plan.config_dtype, quantization=plan.quantization)
        write_generation_config(spec, staging)
        copy_side_files(Path(spec.config_dir), staging)
    if adapter is not None:
        base = base_model or adapter_base_model(Path(spec.config_dir))
        write_adapter(adapter, index, staging / ADAPTER_SUBDIR, base_model=base, progress=progress)
        if plan is None:
            copy_side_files(Path(spec.config_dir), staging / ADAPTER_SUBDIR)


def adapter_base_model(config_dir: Path) -> str | None:
    """The Hub model the config was saved from (its `_name_or_path`), which an adapter names as its base; None
    for a local path (uploaded, it would name a folder on this machine) or nothing."""
    try:
        name = json.loads((config_dir / CONFIG_FILE).read_text()).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    return name if is_hub_model_id(name) else None


def describe_output(
    plan: MergePlan | None,
    adapter: AdapterPlan | None,
    folder: Path,
    written: list[ShardWritten],
    *,
    seconds: float,
) -> SavedModel:
    """The manifest of a finished model folder."""
    weights = plan if plan is not None else adapter.weights
    clear_shard_markers(folder, plan.shard_to_names if plan is not None else ())
    return SavedModel(
        folder=str(folder),
        files=describe_files(folder),
        fp8_errors={name: error for shard in written for name, error in shard.fp8_errors.items()},
        fp8_outside=tuple(name for shard in written for name in shard.fp8_outside),
        weight_files=tuple(plan.shard_to_names) if plan is not None else (),
        total_size=weights.total_size,
        num_tensors=len(weights.tensors),
        dtype=weights.config_dtype,
        seconds=seconds,
        adapter_dir=str(Path(folder) / ADAPTER_SUBDIR) if adapter is not None else None,
    )


def relocated(saved: SavedModel, target_dir: Path) -> SavedModel:
    """The same manifest once its folder has been published: renamed to `target_dir`."""
    adapter_dir = str(target_dir / ADAPTER_SUBDIR) if saved.adapter_dir is not None else None
    return dataclasses.replace(saved, folder=str(target_dir), adapter_dir=adapter_dir, published=True)


def write_adapter(
    adapter: AdapterPlan, index: TensorIndex, adapter_dir: Path, *, base_model: str | None, progress: bool = True
) -> None:
    """The adapter folder as PEFT's save_pretrained writes it: adapter_config.json and adapter_model.safetensors."""
    adapter_dir.mkdir(exist_ok=True)  # a resumed merge finds it
    write_weights(adapter.weights, index, adapter_dir, progress=progress)
    clear_shard_markers(adapter_dir, adapter.weights.shard_to_names)
    config = copy.deepcopy(adapter.config)
    config.base_model_name_or_path = base_model
    config.save_pretrained(str(adapter_dir))


def write_weights(
    plan: MergePlan,
    index: TensorIndex,
    output_dir: Path,
    *,
    progress: bool = True,
    chunk_bytes: int = CHUNK_BYTES,
) -> list[ShardWritten]:
    """Stream every planned shard file from the checkpoint into `output_dir`, one after another."""
    with tqdm(total=plan.total_size, unit="B", unit_scale=True, desc="merging", disable=None if progress else True) as bar:
        return [
            write_shard(plan, index, output_dir, filename, chunk_bytes=chunk_bytes, on_bytes=bar.update)
            for filename in plan.shard_to_names
        ]


def write_shard(
    plan: MergePlan,
    index: TensorIndex,
    output_dir: Path,
    filename: str,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    on_bytes: Callable[[int], object] | None = None,
    written_ahead_for: int | None = None,
) -> ShardWritten:
    """Stream one planned safetensors file from the checkpoint, resumably (`written_ahead_for`: the command whose
    write-ahead child writes it, recorded with it).

    The file is written as `<name>.partial` and renamed when complete, then a `.<name>.done` marker
    records its size and a digest of its plan. A shard whose marker and file agree with the
    plan is kept as it is, so a merge killed part way only writes the shards it had not finished. Writers
    of the same file (a write started before the flow, another process) take turns on a file lock, and the
    later one keeps what the first wrote. Chunks are read on a background thread while the previous ones
    are written; what was read is checked against the checkpoint's checksums before the file is kept.
    """
    tensors = tensors_in_write_order(plan, filename)
    entries = [TensorEntry(t.name, t.dtype, t.shape) for t in tensors]
    final, marker = output_dir / filename, shard_marker(output_dir, filename)
    expected_size = len(build_header(entries)) + sum(entry.nbytes for entry in entries)
    planned = shard_plan_digest(plan, filename)
    with file_lock(output_dir / f".{filename}{LOCK_SUFFIX}", fcntl.LOCK_EX):
        finished = _finished_shard(final, marker, expected_size, planned)
        if finished is not None:
            if on_bytes is not None:
                on_bytes(sum(entry.nbytes for entry in entries))
            return finished
        partial = final.with_name(final.name + PARTIAL_SUFFIX)
        with contextlib.closing(PlannedTensors(index)) as reader, SafetensorsWriter(partial, entries) as writer:
            for tensor_name, chunk in prefetched(_chunks(tensors, reader, chunk_bytes)):
                writer.write(tensor_name, chunk)
                if on_bytes is not None:
                    on_bytes(chunk.numel() * chunk.element_size())
            reader.verify()
        written = ShardWritten(
            filename,
            expected_size,
            written_ahead_for=written_ahead_for,
            fp8_errors=reader.fp8_errors,
            fp8_outside=tuple(reader.fp8_outside),
        )
        os.replace(partial, final)
        marker_tmp = marker.with_name(marker.name + PARTIAL_SUFFIX)
        marker_tmp.write_text(json.dumps({**dataclasses.asdict(written), "plan": planned}))
        os.replace(marker_tmp, marker)
    return written


def tensors_in_write_order(plan: MergePlan, filename: str) -> list[OutputTensor]:
    return sorted((plan.tensors[name] for name in plan.shard_to_names[filename]), key=_safetensors_order)


def sources_in_write_order(plan: MergePlan) -> list[str]:
    """The checkpoint tensors the weight files are written from, in the order `write_shard` reads them."""
    return [tensor.source for filename in plan.shard_to_names for tensor in tensors_in_write_order(plan, filename)]


def shard_plan_digest(plan: MergePlan, filename: str) -> str:
    """A digest of what file `filename` holds: each tensor's name, source, shape, dtype, view and fold."""
    tensors = [plan.tensors[name] for name in sorted(plan.shard_to_names[filename])]
    return hashlib.sha256(repr(tensors).encode()).hexdigest()


def shard_marker(output_dir: Path, filename: str) -> Path:
    return output_dir / f".{filename}{DONE_SUFFIX}"


def clear_shard_markers(folder: Path, weight_files: Iterable[str]) -> None:
    """Once every shard is written (and no writer of `shard_writers` is left), remove the resume markers,
    locks, any unfinished `.partial` file, and weight files other than `weight_files` (written ahead with a
    guessed spec that planned the files otherwise, `MergeJob.guess_spec`)."""
    weight_files = set(weight_files)
    with closed_to_writers(folder):
        for path in folder.iterdir():
            hidden = path.name.startswith(".")
            stray = path.suffix == SAFETENSORS_SUFFIX and path.name not in weight_files
            if (hidden and path.name.endswith((DONE_SUFFIX, LOCK_SUFFIX))) or path.name.endswith(PARTIAL_SUFFIX) or stray:
                path.unlink()


def _finished_shard(final: Path, marker: Path, expected_size: int, planned: str) -> ShardWritten | None:
    if not (final.is_file() and marker.is_file()):
        return None
    try:
        record = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    if record.get("plan") != planned or record.get("size") != expected_size or final.stat().st_size != expected_size:
        return None
    return ShardWritten(
        final.name,
        expected_size,
        resumed=True,
        written_ahead_for=record.get("written_ahead_for"),
        fp8_errors=record.get("fp8_errors", {}),
        fp8_outside=tuple(record.get("fp8_outside", ())),
    )


def _chunks(tensors: list[OutputTensor], reader, chunk_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
    for tensor in tensors:
        for chunk in reader.chunks(tensor, chunk_bytes):
            yield tensor.name, chunk


def _safetensors_order(tensor: OutputTensor) -> tuple[int, str, bool]:
    """safetensors' own order within a file (widest dtype first, then by name), so tensors land at the
    same offsets, and with the same memory alignment once mmapped, as in a file save_pretrained writes;
    a quantized weight's scales come right after it (they are known once it is written)."""
    if tensor.scale_of is not None:
        return -1, tensor.scale_of, True
    return -parse_dtype_name(tensor.dtype).itemsize, tensor.name, False


def write_weight_index(plan: MergePlan, output_dir: Path) -> None:
    """`model.safetensors.index.json` in Hugging Face's layout (`metadata.total_size` in bytes, `weight_map`)."""
    index = {
        "metadata": {"total_size": plan.total_size},
        "weight_map": dict(sorted(plan.name_to_shard.items())),
    }
    (output_dir / WEIGHT_INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
