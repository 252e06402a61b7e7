"""Helpers the tests share: merge with the engine alone, and load what a merge wrote."""

import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint
import transformers
from safetensors.torch import load_file

from mergeflow.formats.dcp import read_metadata, read_slice
from mergeflow.job import MergeJob
from mergeflow.options import MergeOptions
from mergeflow.output.manifest import SavedModel
from mergeflow.output.streaming import CHUNK_BYTES

INPUT_IDS = torch.tensor([[2, 5, 7, 11, 13, 17, 19, 23, 29, 31]])


def merge_with_engine(
    checkpoint_dir: Path, target_dir: Path, *, overwrite: bool = False, chunk_bytes: int = CHUNK_BYTES, **options
) -> SavedModel:
    """The pipeline's steps run by the engine object alone, without Prefect (as the bench runs them)."""
    return MergeJob(checkpoint_dir, target_dir, MergeOptions(**options), chunk_bytes=chunk_bytes).run(overwrite=overwrite)


def load_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor in every .safetensors file of a folder."""
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def model_class(model_dir: Path):
    config = transformers.AutoConfig.from_pretrained(model_dir)
    return getattr(transformers, config.architectures[0])


def logits(model_dir: Path, dtype: torch.dtype) -> torch.Tensor:
    model = model_class(model_dir).from_pretrained(model_dir, dtype=dtype).eval()
    with torch.no_grad():
        return model(INPUT_IDS).logits


def resaved_megatron_checkpoint(
    model_dir: Path, checkpoint_dir: Path, edit: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
) -> Path:
    """A checkpoint in verl's 2025 layout (`dist_ckpt/` beside `huggingface/`) holding a Megatron fixture's
    tensors as `edit` returns them, saved by torch DCP's own writer. Returns `checkpoint_dir`."""
    archive = Path(model_dir) / "dist_ckpt"
    state = edit({key: read_slice(archive, entry) for key, entry in read_metadata(archive).items()})
    shutil.copytree(Path(model_dir) / "huggingface", checkpoint_dir / "huggingface")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it saves from one process
        torch.distributed.checkpoint.save(state, checkpoint_id=checkpoint_dir / "dist_ckpt", no_dist=True)
    return checkpoint_dir
