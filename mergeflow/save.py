"""Execute a merge plan: stream every tensor into safetensors files and write the model folder atomically."""

import contextlib
import copy
import json
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from mergeflow.dtypes import parse_dtype_name
from mergeflow.fsdp import ShardIndex
from mergeflow.hf_config import ModelSpec, copy_side_files, write_config, write_generation_config
from mergeflow.lora import ADAPTER_SUBDIR
from mergeflow.materialize import open_tensors
from mergeflow.output import staged_output
from mergeflow.planning import INDEX_FILE, AdapterPlan, MergePlan, OutputTensor
from mergeflow.safetensors_writer import SafetensorsWriter, TensorEntry
from mergeflow.streaming import CHUNK_BYTES, prefetched


@dataclass(frozen=True)
class OutputFile:
    name: str
    size: int


@dataclass(frozen=True)
class SavedModel:
    """A small manifest of what a merge wrote (no tensors)."""

    target_dir: str
    files: tuple[OutputFile, ...]
    """Every file written, by its path relative to `target_dir`."""
    weight_files: tuple[str, ...]
    total_size: int
    num_tensors: int
    dtype: str
    seconds: float
    adapter_dir: str | None = None


def save_model(
    plan: MergePlan | None,
    index: ShardIndex,
    spec: ModelSpec,
    target_dir: Path,
    *,
    adapter: AdapterPlan | None = None,
    overwrite: bool = False,
    progress: bool = True,
    chunk_bytes: int = CHUNK_BYTES,
) -> SavedModel:
    """Write the merged model to `target_dir`: weights, index, config, generation config and side files,
    and the LoRA adapter in `lora_adapter/` when given. With no `plan` (a LoRA-only checkpoint) only
    the adapter is written.

    `chunk_bytes` bounds each assembled block of rows, and so the merge's memory.
    """
    started = time.monotonic()
    target_dir = Path(target_dir).absolute()
    with staged_output(target_dir, overwrite=overwrite) as staging:
        if plan is not None:
            write_weights(plan, index, staging, progress=progress, chunk_bytes=chunk_bytes)
            write_weight_index(plan, staging)
            write_config(spec, staging, plan.config_dtype)
            write_generation_config(spec, staging)
            copy_side_files(Path(spec.config_dir), staging)
        if adapter is not None:
            base = str(target_dir) if plan is not None else None
            write_adapter(adapter, index, staging / ADAPTER_SUBDIR, base_model=base, progress=progress)
        files = tuple(
            OutputFile(str(p.relative_to(staging)), p.stat().st_size) for p in sorted(staging.rglob("*")) if p.is_file()
        )
    weights = plan if plan is not None else adapter.weights
    return SavedModel(
        target_dir=str(target_dir),
        files=files,
        weight_files=tuple(plan.shard_to_names) if plan is not None else (),
        total_size=weights.total_size,
        num_tensors=len(weights.tensors),
        dtype=weights.config_dtype,
        seconds=time.monotonic() - started,
        adapter_dir=str(target_dir / ADAPTER_SUBDIR) if adapter is not None else None,
    )


def write_adapter(
    adapter: AdapterPlan, index: ShardIndex, adapter_dir: Path, *, base_model: str | None, progress: bool = True
) -> None:
    """The adapter folder as PEFT's save_pretrained writes it: adapter_config.json and adapter_model.safetensors."""
    adapter_dir.mkdir()
    write_weights(adapter.weights, index, adapter_dir, progress=progress)
    config = copy.deepcopy(adapter.config)
    config.base_model_name_or_path = base_model
    config.save_pretrained(str(adapter_dir))


def write_weights(
    plan: MergePlan,
    index: ShardIndex,
    output_dir: Path,
    *,
    progress: bool = True,
    chunk_bytes: int = CHUNK_BYTES,
) -> None:
    """Stream each planned tensor from the rank files into its safetensors file.

    Chunks are assembled on a background thread while the previous ones are written.
    """
    files = {
        filename: sorted((plan.tensors[name] for name in names), key=_safetensors_order)
        for filename, names in plan.shard_to_names.items()
    }
    with (
        contextlib.closing(open_tensors(index)) as reader,
        tqdm(total=plan.total_size, unit="B", unit_scale=True, desc="merging", disable=not progress) as bar,
        contextlib.ExitStack() as open_file,
    ):
        writer = None
        for filename, name, chunk in prefetched(_chunks_in_write_order(files, index, reader, chunk_bytes)):
            if writer is None or writer.path.name != filename:
                open_file.close()
                entries = [TensorEntry(t.name, t.dtype, t.shape) for t in files[filename]]
                writer = open_file.enter_context(SafetensorsWriter(output_dir / filename, entries))
            writer.write(name, chunk)
            bar.update(chunk.numel() * chunk.element_size())


def _chunks_in_write_order(
    files: dict[str, list[OutputTensor]], index: ShardIndex, reader, chunk_bytes: int
):
    for filename, tensors in files.items():
        for tensor in tensors:
            for chunk in reader.chunks(tensor, chunk_bytes):
                yield filename, tensor.name, chunk


def _safetensors_order(tensor) -> tuple[int, str]:
    """safetensors' own order within a file (widest dtype first, then by name), so tensors land at the
    same offsets, and with the same memory alignment once mmapped, as in a file save_pretrained writes."""
    return -parse_dtype_name(tensor.dtype).itemsize, tensor.name


def write_weight_index(plan: MergePlan, output_dir: Path) -> None:
    """`model.safetensors.index.json` in Hugging Face's layout (`metadata.total_size` in bytes, `weight_map`)."""
    index = {
        "metadata": {"total_size": plan.total_size},
        "weight_map": dict(sorted(plan.name_to_shard.items())),
    }
    (output_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
