"""Helpers the tests share: merge with the engine alone, and load what a merge wrote."""

from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file

from mergeflow.formats.fsdp.index import index_shards
from mergeflow.formats.fsdp.layout import default_config_dir, find_rank_files
from mergeflow.lora import plan_lora
from mergeflow.output.manifest import SavedModel
from mergeflow.output.save import save_model
from mergeflow.perf.read_ahead import read_ahead
from mergeflow.planning import plan_adapter, plan_merge
from mergeflow.spec.model_spec import load_model_spec
from mergeflow.streaming import CHUNK_BYTES

INPUT_IDS = torch.tensor([[2, 5, 7, 11, 13, 17, 19, 23, 29, 31]])


def merge_with_engine(checkpoint_dir: Path, target_dir: Path, **options) -> SavedModel:
    """The flow's steps called directly, without Prefect."""
    max_shard_size = options.pop("max_shard_size", "5GB")
    overwrite = options.pop("overwrite", False)
    chunk_bytes = options.pop("chunk_bytes", CHUNK_BYTES)
    merge_lora = options.pop("merge_lora", False)
    lora_alpha = options.pop("lora_alpha", None)
    rank_files = find_rank_files(checkpoint_dir)
    with read_ahead(rank_files.data_files):
        spec = load_model_spec(default_config_dir(checkpoint_dir))
    index = index_shards(rank_files)
    lora = plan_lora(index, spec, merge=merge_lora, lora_alpha=lora_alpha)
    adapter = plan_adapter(index, lora, **options) if lora is not None and not lora.merge else None
    lora_only = lora is not None and lora.lora_only
    plan = None if lora_only else plan_merge(index, spec, max_shard_size=max_shard_size, lora=lora, **options)
    return save_model(
        plan,
        index,
        spec,
        target_dir,
        adapter=adapter,
        overwrite=overwrite,
        progress=False,
        chunk_bytes=chunk_bytes,
    )


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
