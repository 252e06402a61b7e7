"""The Hugging Face config directory a checkpoint brings (`huggingface/`): its file names, and the check
that it holds a config (imports no torch)."""

from pathlib import Path

from mergeflow.errors import CheckpointError

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
WEIGHT_INDEX_FILE = "model.safetensors.index.json"
"""The index of a model's weight files, in Hugging Face's layout (`metadata.total_size`, `weight_map`)."""


def require_config(config_dir: Path) -> Path:
    """config.json of `config_dir`, which must exist.

    Raises:
        CheckpointError: there is no config.json there.
    """
    path = Path(config_dir) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(
            f"missing {path}: verl saves the model config in <checkpoint>/huggingface/",
            hint="pass --hf_model_config_path DIR if it lives elsewhere (verl's TorchTitan engine saves none: pass the "
            "model the run started from)",
        )
    return path
