"""Checkpoints that already hold a Hugging Face model, found by file names alone (imports no torch): Automodel's
`model/consolidated/`, the `huggingface/` folder of an FSDP save whose `save_contents` is `hf_model` only (or of an
mbridge run of 2025), or a model folder itself. Nothing is merged: the tree is copied byte for byte, then
validated and published like a merge's output."""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from mergeflow.errors import CheckpointError, quoted
from mergeflow.formats.verl_run import HF_SUBDIR, default_config_dir, wrong_level_hint
from mergeflow.spec.config_files import CONFIG_FILE, WEIGHT_INDEX_FILE

CONSOLIDATED_SUBDIR = "model/consolidated"
"""Where verl's Automodel engine saves the loadable HF model (config.json, no tokenizer) beside its shards."""
TREE_SUBDIRS = (CONSOLIDATED_SUBDIR, HF_SUBDIR, f"model/{HF_SUBDIR}", ".")
"""Where a checkpoint's HF model may be, in the order they are looked at."""
WEIGHT_FILES = "*.safetensors"


@dataclass(frozen=True)
class HfTree:
    """A checkpoint that holds a loadable Hugging Face model."""

    checkpoint_dir: str
    model_dir: str
    """The folder that holds the model: config.json and its safetensors weights."""
    config_dir: str
    """Where the config, tokenizer and chat template come from: the checkpoint's `huggingface/` when it has one
    (Automodel's consolidated model holds no tokenizer), else the tree itself."""

    @property
    def world_size(self) -> int:
        return 1

    @property
    def data_files(self) -> tuple[str, ...]:
        """Nothing to read ahead: the weights are copied, not merged."""
        return ()

    def index(self, spec=None) -> NoReturn:
        raise CheckpointError(f"{self.model_dir} already holds the Hugging Face model: there is nothing to merge")


def holds_model(folder: Path) -> bool:
    return (folder / CONFIG_FILE).is_file() and any(folder.glob(WEIGHT_FILES))


def tree_in(checkpoint_dir: Path) -> Path | None:
    """The first of `TREE_SUBDIRS` that holds a model, if any."""
    return next((Path(checkpoint_dir) / sub for sub in TREE_SUBDIRS if holds_model(Path(checkpoint_dir) / sub)), None)


def find_hf_tree(checkpoint_dir: Path) -> HfTree:
    """The checkpoint's HF model, checked to be whole (every weight file its index names is there).

    Raises:
        CheckpointError: the directory is missing, holds no HF model, or one with weight files missing.
    """
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {checkpoint_dir}")
    tree = tree_in(checkpoint_dir)
    if tree is None:
        _not_a_tree(checkpoint_dir)
    missing = missing_weight_files(tree)
    if missing:
        raise CheckpointError(f"weight file(s) missing in {tree}, which {WEIGHT_INDEX_FILE} names: {quoted(missing)}")
    tree = tree.resolve()
    config_dir = default_config_dir(checkpoint_dir)
    return HfTree(str(checkpoint_dir), str(tree), str(config_dir if (config_dir / CONFIG_FILE).is_file() else tree))


def missing_weight_files(tree: Path) -> list[str]:
    """The weight files the tree's index names that are not there (none without an index)."""
    try:
        weight_map = json.loads((tree / WEIGHT_INDEX_FILE).read_text())["weight_map"]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"unreadable {tree / WEIGHT_INDEX_FILE}: {e}") from e
    return sorted({name for name in weight_map.values() if not (tree / name).is_file()})


def recognises(checkpoint_dir: Path) -> bool:
    return tree_in(checkpoint_dir) is not None


def is_complete(checkpoint_dir: Path) -> bool:
    """A tree whose index names weight files still being written is not complete yet."""
    try:
        find_hf_tree(checkpoint_dir)
    except CheckpointError:
        return False
    return True


def is_training_file(name: str, is_dir: bool) -> bool:
    """An HF tree's files are what a merge writes too: none of them marks a training run."""
    return False


def _not_a_tree(directory: Path) -> NoReturn:
    places = ", ".join(f"{sub}/" for sub in TREE_SUBDIRS if sub != ".")
    message = f"no Hugging Face model in {directory}: config.json with {WEIGHT_FILES} weights in none of {places} or itself"
    hint = wrong_level_hint(directory, recognises)
    raise CheckpointError(f"{message}; {hint}" if hint else message)
