"""Where a Megatron checkpoint's parts are, in either of verl's layouts (names only: imports no torch)."""

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mergeflow.errors import CheckpointError
from mergeflow.formats.dcp_files import DATA_FILE, METADATA_FILE, data_files, writer_ranks
from mergeflow.formats.megatron.contents import (
    CONTENTS_FILE,
    HF_FORMAT,
    CheckpointContents,
    is_v2_layout,
    read_contents,
)
from mergeflow.formats.verl_run import HF_SUBDIR, ROLE_SUBDIRS, TORCHTITAN_STEP_DIR

if TYPE_CHECKING:
    from mergeflow.formats.megatron.index import MegatronIndex
    from mergeflow.spec.model_spec import ModelSpec

DIST_CKPT_SUBDIR = "dist_ckpt"
HF_WEIGHT_FILES = "*.safetensors"
MODEL_SUBDIR = "model"
TRANSFORMER_CONFIG_FILE = "transformer_config.json"
"""megatron-core's TransformerConfig, as verl saves it with the `extra` contents."""
PARALLEL_SIZES = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "context_parallel_size",
    "mtp_num_layers",
)


@dataclass(frozen=True)
class MegatronLayout:
    """Where a Megatron checkpoint's parts are."""

    checkpoint_dir: str
    """What the user passed (`global_step_N/actor`)."""
    dist_ckpt_dir: str | None
    hf_dir: str
    hf_weights: bool = False
    """`hf_dir` already holds the model's weights (verl with mbridge saves them): nothing to merge."""

    @property
    def world_size(self) -> int:
        """Ranks that wrote the archive (1 when there is none)."""
        return writer_ranks(self.dist_ckpt_dir) if self.dist_ckpt_dir else 1

    @property
    def data_files(self) -> tuple[str, ...]:
        """The archive's tensor data files (none for an mbridge run, whose weights are copied)."""
        if self.dist_ckpt_dir is None or self.hf_weights:
            return ()
        return data_files(self.dist_ckpt_dir)

    @property
    def config_dir(self) -> str:
        return self.hf_dir

    @property
    def saved_layout(self) -> str:
        """Which of verl's layouts this is, as `inspect` names it."""
        checkpoint = Path(self.checkpoint_dir)
        if (checkpoint / CONTENTS_FILE).is_file():
            return f"verl v2 ({CONTENTS_FILE})"
        if self.dist_ckpt_dir is None or self.hf_weights:
            return f"Hugging Face weights in {os.path.relpath(self.hf_dir, checkpoint)}"
        return f"{os.path.relpath(self.dist_ckpt_dir, checkpoint)}/ without {CONTENTS_FILE}"

    def parallelism(self) -> dict[str, int]:
        """The parallel sizes megatron-core was configured with, from the `transformer_config.json` verl saves
        beside the archive (empty without one)."""
        path = Path(self.checkpoint_dir) / TRANSFORMER_CONFIG_FILE
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(config, dict):
            return {}
        return {name: config[name] for name in PARALLEL_SIZES if isinstance(config.get(name), int)}

    @property
    def model_dir(self) -> str | None:
        """`huggingface/` when it already holds the model's weights (an mbridge run): nothing to merge."""
        return self.hf_dir if self.hf_weights else None

    def index(self, spec: "ModelSpec") -> "MegatronIndex":
        """The archive's tensors under Hugging Face names, from `.metadata` and the config's geometry."""
        from mergeflow.formats.megatron.index import index_megatron

        return index_megatron(self, spec)


def find_megatron_checkpoint(local_dir: Path) -> MegatronLayout:
    """Locate the model's weights and config: where `ckpt_contents.json` says (verl's v2 layout), else
    `model/{dist_ckpt,huggingface}/` or the older `{dist_ckpt,huggingface}/`. A `huggingface/` that holds
    safetensors weights (an mbridge run) is the model itself.

    Raises:
        CheckpointError: no layout is there (naming the directory to pass when it is a parent), the manifest
            is unreadable or names weights that are not there.
    """
    local_dir = Path(local_dir)
    if not local_dir.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {local_dir}")
    contents = read_contents(local_dir)
    if contents is not None:
        return _from_contents(local_dir, contents)
    for base in (local_dir / MODEL_SUBDIR, local_dir):
        if any((base / HF_SUBDIR).glob(HF_WEIGHT_FILES)):
            dist_ckpt = base / DIST_CKPT_SUBDIR
            return MegatronLayout(
                str(local_dir), str(dist_ckpt) if dist_ckpt.is_dir() else None, str(base / HF_SUBDIR), hf_weights=True
            )
        if (base / DIST_CKPT_SUBDIR).is_dir():
            return MegatronLayout(str(local_dir), str(_archive(base / DIST_CKPT_SUBDIR)), str(base / HF_SUBDIR))
    if (local_dir / METADATA_FILE).is_file() and not TORCHTITAN_STEP_DIR.match(local_dir.name):
        return MegatronLayout(str(local_dir), str(local_dir), str(local_dir.parent / HF_SUBDIR))
    roles = [role for role in ROLE_SUBDIRS if (local_dir / role).is_dir()]
    hint = f": pass {local_dir / roles[0]}" if roles else ""
    raise CheckpointError(
        f"not a Megatron checkpoint: {local_dir} has neither {MODEL_SUBDIR}/{DIST_CKPT_SUBDIR}/ nor "
        f"{DIST_CKPT_SUBDIR}/{hint}"
    )


def recognises(local_dir: Path) -> bool:
    """Whether the directory is in one of the layouts `find_megatron_checkpoint` reads, with a mark of Megatron (a
    torch_dist archive, or verl's manifest): a bare `huggingface/` with weights is any engine's Hugging Face model
    (the `hf` backend's)."""
    try:
        layout = find_megatron_checkpoint(local_dir)
    except CheckpointError:
        return False
    return layout.dist_ckpt_dir is not None or (Path(local_dir) / CONTENTS_FILE).is_file()


def is_complete(local_dir: Path) -> bool:
    """verl's v2 layout writes `ckpt_contents.json` last: a v2 checkpoint without it is still being saved."""
    return not is_v2_layout(local_dir) or (local_dir / CONTENTS_FILE).is_file()


def is_training_file(name: str, is_dir: bool) -> bool:
    """`dist_ckpt/`, the archive's `.metadata` and data files, and verl's manifest."""
    if is_dir:
        return name == DIST_CKPT_SUBDIR
    return name in (METADATA_FILE, CONTENTS_FILE) or bool(DATA_FILE.match(name))


def _from_contents(local_dir: Path, contents: CheckpointContents) -> MegatronLayout:
    config_dir = contents.config_dir or local_dir / MODEL_SUBDIR / HF_SUBDIR
    if contents.model_format == HF_FORMAT and contents.adapters_path is not None:
        return MegatronLayout(str(local_dir), str(_archive(contents.adapters_path)), str(config_dir))
    if contents.model_format == HF_FORMAT:
        if not any(contents.model_path.glob(HF_WEIGHT_FILES)):
            raise CheckpointError(
                f"{local_dir / CONTENTS_FILE} names Hugging Face weights in {contents.model_path}, which holds none"
            )
        return MegatronLayout(str(local_dir), None, str(contents.model_path), hf_weights=True)
    return MegatronLayout(str(local_dir), str(_archive(contents.model_path)), str(config_dir))


def _archive(dist_ckpt: Path) -> Path:
    """`dist_ckpt`, checked to be a torch_dist archive."""
    if not (dist_ckpt / METADATA_FILE).is_file():
        raise CheckpointError(f"not a torch_dist checkpoint: {dist_ckpt} has no {METADATA_FILE} file")
    return dist_ckpt

