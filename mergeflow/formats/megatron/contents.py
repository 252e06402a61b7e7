"""verl's `ckpt_contents.json`: the manifest its Megatron checkpoint manager (layout schema v2) writes last,
naming where each saved content lives under the checkpoint directory (names only: imports no torch)."""

import json
from dataclasses import dataclass
from pathlib import Path

from mergeflow.errors import CheckpointError

CONTENTS_FILE = "ckpt_contents.json"
SCHEMA_VERSION = 2
DIST_CKPT_FORMAT = "megatron_dist_checkpoint"
HF_FORMAT = "huggingface"
V2_SUBDIRS = ("model", "optimizer", "extra")
"""Subdirectories only the v2 layout has: a checkpoint with one of them is complete once its manifest is."""


@dataclass(frozen=True)
class CheckpointContents:
    """What the manifest says about the model: where its weights are, in which format, and its config."""

    model_path: Path
    model_format: str
    """`megatron_dist_checkpoint` (a torch_dist archive) or `huggingface` (weights saved through a bridge)."""
    config_dir: Path | None
    adapters_path: Path | None = None
    """The torch_dist archive of a PEFT (LoRA) run's adapters alone, which verl saves beside their HF export."""


def is_v2_layout(checkpoint_dir: Path) -> bool:
    return any((checkpoint_dir / name).is_dir() for name in V2_SUBDIRS)


def read_contents(checkpoint_dir: Path) -> CheckpointContents | None:
    """The manifest's model entries, or None when the checkpoint has no manifest.

    Raises:
        CheckpointError: an unreadable manifest, a schema this reader does not know, no model weights, or a
            path that leaves the checkpoint directory.
    """
    path = checkpoint_dir / CONTENTS_FILE
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
        contents = manifest["contents"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{path}: not a verl checkpoint manifest ({error})") from None
    if not isinstance(contents, dict):
        raise CheckpointError(f"{path}: not a verl checkpoint manifest (its contents are not a mapping)")
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise CheckpointError(
            f"{path}: layout schema_version {manifest.get('schema_version')!r}; mergeflow reads version {SCHEMA_VERSION}"
        )
    model = contents.get("model") or contents.get("hf_model")
    if not isinstance(model, dict) or model.get("format") not in (DIST_CKPT_FORMAT, HF_FORMAT):
        saved = manifest.get("save_contents")
        raise CheckpointError(f"{path}: the checkpoint holds no model weights (save_contents: {saved})")
    config = contents.get("hf_config")
    adapters = contents.get("peft_adapters")
    return CheckpointContents(
        model_path=_inside(checkpoint_dir, model.get("path"), path),
        model_format=model["format"],
        config_dir=_inside(checkpoint_dir, config.get("path"), path) if isinstance(config, dict) else None,
        adapters_path=_inside(checkpoint_dir, adapters.get("path"), path)
        if isinstance(adapters, dict) and adapters.get("format") == DIST_CKPT_FORMAT
        else None,
    )


def _inside(checkpoint_dir: Path, relative: object, manifest: Path) -> Path:
    """`checkpoint_dir / relative`, refusing a path that is absolute or climbs out of the checkpoint."""
    if not isinstance(relative, str) or Path(relative).is_absolute() or ".." in Path(relative).parts:
        raise CheckpointError(f"{manifest}: path {relative!r} does not lie inside the checkpoint directory")
    return checkpoint_dir / relative
