"""The files of a model folder besides its weights, from the checkpoint's config directory: config.json with its
dtype updated, generation_config.json, and the tokenizer, processor, chat-template and remote-code files, copied
byte for byte."""

import json
import shutil
from pathlib import Path

from mergeflow.spec.config_files import CONFIG_FILE, GENERATION_CONFIG_FILE
from mergeflow.spec.model_spec import WEIGHT_INDEX_SUFFIX, WEIGHT_SUFFIXES, ModelSpec


def write_config(spec: ModelSpec, output_dir: Path, dtype: str, *, quantization: dict | None = None) -> None:
    """Write config.json as the checkpoint has it, with only its dtype (and value-model head, and an FP8 model's
    `quantization_config`) updated."""
    config = json.loads((Path(spec.config_dir) / CONFIG_FILE).read_text())
    if spec.is_value_model and config.get("architectures") != [spec.architecture]:
        config["architectures"] = [spec.architecture]
        config["id2label"] = {"0": "LABEL_0"}
        config["label2id"] = {"LABEL_0": 0}
    _set_dtype(config, dtype)
    if quantization is not None:
        config["quantization_config"] = quantization
    (Path(output_dir) / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _set_dtype(config: dict, dtype: str) -> None:
    config["dtype"] = dtype
    if "torch_dtype" in config:
        config["torch_dtype"] = dtype
    for value in config.values():
        if isinstance(value, dict) and ("dtype" in value or "torch_dtype" in value):
            _set_dtype(value, dtype)


def write_generation_config(spec: ModelSpec, output_dir: Path) -> None:
    """Copy the checkpoint's generation_config.json; without one, derive it from the model config as verl does."""
    source = Path(spec.config_dir) / GENERATION_CONFIG_FILE
    if source.is_file():
        shutil.copyfile(source, Path(output_dir) / GENERATION_CONFIG_FILE)
    elif spec.derived_generation_config is not None:
        (Path(output_dir) / GENERATION_CONFIG_FILE).write_text(spec.derived_generation_config)


def side_files(config_dir: Path) -> list[Path]:
    """Tokenizer, processor, chat template and remote-code files: every top-level file but weights and configs."""
    handled = {CONFIG_FILE, GENERATION_CONFIG_FILE}
    return sorted(
        path
        for path in Path(config_dir).iterdir()
        if path.is_file()
        and path.name not in handled
        and not path.name.endswith(WEIGHT_SUFFIXES)
        and not path.name.endswith(WEIGHT_INDEX_SUFFIX)
    )


def copy_side_files(config_dir: Path, output_dir: Path) -> list[str]:
    """Copy the side files byte for byte (never loaded and re-saved, which would change them)."""
    copied = []
    for path in side_files(config_dir):
        shutil.copyfile(path, Path(output_dir) / path.name)
        copied.append(path.name)
    return copied
