"""Execute a merge plan: stream every tensor into safetensors files and write the model folder atomically."""

import json
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from mergeflow.dtypes import parse_dtype_name
from mergeflow.fsdp import RankReader, ShardIndex
from mergeflow.hf_config import ModelSpec, copy_side_files, write_config, write_generation_config
from mergeflow.output import staged_output
from mergeflow.planning import INDEX_FILE, MergePlan
from mergeflow.safetensors_writer import SafetensorsWriter, TensorEntry
from mergeflow.streaming import tensor_chunks


@dataclass(frozen=True)
class OutputFile:
    name: str
    size: int


@dataclass(frozen=True)
class SavedModel:
    """A small manifest of what a merge wrote (no tensors)."""

    target_dir: str
    files: tuple[OutputFile, ...]
    weight_files: tuple[str, ...]
    total_size: int
    num_tensors: int
    dtype: str
    seconds: float


def save_model(
    plan: MergePlan,
    index: ShardIndex,
    spec: ModelSpec,
    target_dir: Path,
    *,
    overwrite: bool = False,
    progress: bool = True,
) -> SavedModel:
    """Write the merged model to `target_dir`: weights, index, config, generation config and side files."""
    started = time.monotonic()
    with staged_output(Path(target_dir), overwrite=overwrite) as staging:
        write_weights(plan, index, staging, progress=progress)
        write_weight_index(plan, staging)
        write_config(spec, staging, plan.config_dtype)
        write_generation_config(spec, staging)
        copy_side_files(Path(spec.config_dir), staging)
        files = tuple(OutputFile(p.name, p.stat().st_size) for p in sorted(staging.iterdir()) if p.is_file())
    return SavedModel(
        target_dir=str(Path(target_dir).absolute()),
        files=files,
        weight_files=tuple(plan.shard_to_names),
        total_size=plan.total_size,
        num_tensors=len(plan.tensors),
        dtype=plan.config_dtype,
        seconds=time.monotonic() - started,
    )


def write_weights(plan: MergePlan, index: ShardIndex, output_dir: Path, *, progress: bool = True) -> None:
    """Stream each planned tensor from the rank files into its safetensors file."""
    with (
        RankReader(index.rank_files) as reader,
        tqdm(total=plan.total_size, unit="B", unit_scale=True, desc="merging", disable=not progress) as bar,
    ):
        for filename, names in plan.shard_to_names.items():
            tensors = sorted((plan.tensors[name] for name in names), key=_safetensors_order)
            entries = [TensorEntry(t.name, t.dtype, t.shape) for t in tensors]
            with SafetensorsWriter(output_dir / filename, entries) as writer:
                for tensor in tensors:
                    source = index.tensors[tensor.source]
                    chunks = tensor_chunks(
                        source,
                        parse_dtype_name(tensor.dtype),
                        lambda block, source=source: reader.local(source.name, block.rank),
                    )
                    for chunk in chunks:
                        writer.write(tensor.name, chunk)
                        bar.update(chunk.numel() * chunk.element_size())


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
