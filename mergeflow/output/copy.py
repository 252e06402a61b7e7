"""A checkpoint that already holds a Hugging Face model (mbridge's export, Automodel's consolidated model, an FSDP
save of `hf_model` only): nothing to merge, so its folder is copied byte for byte and then validated like a merge."""

import json
import shutil
import time
from pathlib import Path

from mergeflow.dtypes import dtype_name
from mergeflow.output.manifest import SavedModel, describe_files
from mergeflow.output.model_files import side_files
from mergeflow.output.model_folder import SafetensorsFolder, dominant_floating_dtype, nbytes
from mergeflow.spec.config_files import CONFIG_FILE, GENERATION_CONFIG_FILE


def copy_model_folder(source_dir: Path, output_dir: Path, *, config_dir: Path | None = None) -> SavedModel:
    """Copy every file of `source_dir` (weights, config, tokenizer and the rest) into `output_dir`, and, from
    `config_dir`, the tokenizer, chat template and generation config files `source_dir` lacks (Automodel's
    consolidated model holds none), all byte for byte."""
    started = time.monotonic()
    for path in sorted(Path(source_dir).rglob("*")):
        if path.is_file():
            destination = Path(output_dir) / path.relative_to(source_dir)
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, destination)
    if config_dir is not None and Path(config_dir).resolve() != Path(source_dir).resolve():
        for path in [*side_files(Path(config_dir)), Path(config_dir) / GENERATION_CONFIG_FILE]:
            if path.is_file() and not (Path(output_dir) / path.name).exists():
                shutil.copyfile(path, Path(output_dir) / path.name)
    weights = SafetensorsFolder(Path(output_dir))
    dominant = dominant_floating_dtype(weights)
    return SavedModel(
        folder=str(output_dir),
        files=describe_files(Path(output_dir)),
        weight_files=tuple(weights.files),
        total_size=sum(nbytes(weights.info(name)) for name in weights.names()),
        num_tensors=len(weights.names()),
        dtype=_config_dtype(Path(output_dir)) or (dtype_name(dominant) if dominant else "unknown"),
        seconds=time.monotonic() - started,
    )


def _config_dtype(model_dir: Path) -> str | None:
    try:
        config = json.loads((model_dir / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return None
    return config.get("dtype") or config.get("torch_dtype")
