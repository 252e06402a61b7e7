"""What `mergeflow inspect` reports about a checkpoint, from metadata alone (nothing is merged)."""

import json
import math
import re
from collections import Counter
from pathlib import Path

from mergeflow.errors import CheckpointError
from mergeflow.formats.base import TensorIndex
from mergeflow.formats.registry import backend_named, find_checkpoint
from mergeflow.lora import recorded_alpha
from mergeflow.options import DEFAULT_BACKEND
from mergeflow.planning import mtp_layer_names
from mergeflow.spec.config_files import CONFIG_FILE
from mergeflow.spec.model_spec import ModelSpec, load_model_spec
from mergeflow.spec.peft_names import PEFT_PREFIX, lora_tensor_names


def describe_checkpoint(
    local_dir: Path,
    *,
    backend: str = DEFAULT_BACKEND,
    hf_model_config_path: Path | None = None,
    trust_remote_code: bool = False,
) -> dict:
    """World size, how it was saved (layout, mesh and placements, or tensor parallelism and the parallel
    sizes verl recorded), dtypes, parameter count, multi-token-prediction layers, and tied / LoRA /
    value-model flags."""
    layout = find_checkpoint(local_dir, backend)
    if layout.model_dir is not None:
        return _describe_model_folder(Path(local_dir), backend, Path(layout.model_dir))
    spec = _spec_or_none(Path(hf_model_config_path or layout.config_dir), trust_remote_code)
    if spec is None and backend_named(backend).needs_spec:
        raise CheckpointError(f"{layout.config_dir}: a {backend} checkpoint is named through its config, which cannot be read")
    index = layout.index(spec)
    tied = dict(spec.tied) if spec else dict(index.aliases)
    counted = [t for name, t in index.tensors.items() if name not in tied and name not in index.aliases]
    names = list(index.tensors)
    lora_names = lora_tensor_names(names)
    description = {
        "checkpoint_dir": str(Path(local_dir).absolute()),
        "backend": backend,
        "world_size": index.world_size,
        **index.facts(),
        "dtypes": dict(Counter(t.dtype for t in index.tensors.values())),
        "num_tensors": len(index.tensors),
        "num_parameters": sum(math.prod(t.shape) for t in counted),
        "architecture": spec.architecture if spec else None,
        "model_type": _model_type(Path(spec.config_dir)) if spec else None,
        "mtp_layers": len({match[1] for name in mtp_layer_names(names, spec) if (match := MTP_LAYER.match(name))})
        if spec
        else 0,
        "tied": tied,
        "lora": bool(lora_names),
        "value_model": spec.is_value_model
        if spec
        else any(name.removeprefix(PEFT_PREFIX).startswith("score.") for name in names),
    }
    if lora_names:
        description.update(_lora_description(index, lora_names))
    return description


def _describe_model_folder(local_dir: Path, backend: str, model_dir: Path) -> dict:
    """A checkpoint that holds the Hugging Face model already (it is copied, not merged): its weights' facts."""
    from mergeflow.output.model_folder import SafetensorsFolder

    weights = SafetensorsFolder(model_dir)
    infos = [weights.info(name) for name in weights.names()]
    return {
        "checkpoint_dir": str(local_dir.absolute()),
        "backend": backend,
        "model_dir": str(model_dir),
        "merge": "none: the model is copied as it is",
        "dtypes": dict(Counter(str(info.dtype).removeprefix("torch.") for info in infos)),
        "num_tensors": len(infos),
        "num_parameters": sum(math.prod(info.shape) for info in infos),
        "model_type": _model_type(model_dir),
    }


MTP_LAYER = re.compile(r"^(?:model|mtp)\.layers\.(\d+)\.")
"""An MTP layer's tensor, as DeepSeek-V3's checkpoints name it or as Qwen3-Next's do."""


def _lora_description(index: TensorIndex, lora_names: list[str]) -> dict:
    ranks = Counter(index.tensors[name].shape[0] for name in lora_names if ".lora_A." in name or ".lora_embedding_A." in name)
    alpha = recorded_alpha(Path(index.checkpoint_dir))
    return {
        "lora_ranks": {str(rank): count for rank, count in sorted(ranks.items())},
        "lora_alpha": alpha[0] if alpha else None,
        "lora_only": len(lora_names) == len(index.tensors),
    }


def _model_type(config_dir: Path) -> str | None:
    try:
        return json.loads((config_dir / CONFIG_FILE).read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def _spec_or_none(config_dir: Path, trust_remote_code: bool) -> ModelSpec | None:
    try:
        return load_model_spec(config_dir, trust_remote_code=trust_remote_code)
    except CheckpointError:
        return None


def format_description(description: dict) -> str:
    """Aligned `key: value` lines for the terminal."""
    width = max(map(len, description))
    return "\n".join(f"{key:<{width}}  {value}" for key, value in description.items())
