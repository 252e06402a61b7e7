"""A checkpoint of verl's TorchTitan engine, found by file names alone (imports no torch): torchtitan's own DCP
archive in `global_step_N/step-N/` (model, optimizer, LR scheduler and train state in one archive), and no
`huggingface/`: the config comes from the model the run started from (`--hf_model_config_path`)."""

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mergeflow.errors import CheckpointError, quoted
from mergeflow.formats.dcp_files import METADATA_FILE, data_files, writer_ranks
from mergeflow.formats.verl_run import ROLE_SUBDIRS, TORCHTITAN_STEP_DIR, default_config_dir

if TYPE_CHECKING:
    from mergeflow.formats.torchtitan.index import TorchTitanIndex
    from mergeflow.spec.model_spec import ModelSpec


@dataclass(frozen=True)
class TorchTitanCheckpoint:
    """Where a TorchTitan checkpoint's archive is."""

    checkpoint_dir: str
    archive_dir: str
    """The `step-N/` DCP archive."""

    @property
    def world_size(self) -> int:
        return writer_ranks(self.archive_dir)

    @property
    def data_files(self) -> tuple[str, ...]:
        return data_files(self.archive_dir)

    @property
    def config_dir(self) -> str:
        """Where verl would keep the config; TorchTitan saves none, so `--hf_model_config_path` is needed."""
        return str(default_config_dir(Path(self.checkpoint_dir)))

    @property
    def model_dir(self) -> None:
        return None

    def index(self, spec: "ModelSpec") -> "TorchTitanIndex":
        from mergeflow.formats.torchtitan.index import index_torchtitan

        return index_torchtitan(self, spec)


def archives_in(directory: Path) -> list[Path]:
    """The directory itself if it is a `step-N/` archive, else the archives in it."""
    directory = Path(directory)
    if TORCHTITAN_STEP_DIR.match(directory.name) and (directory / METADATA_FILE).is_file():
        return [directory]
    if not directory.is_dir():
        return []
    return sorted(
        (path for path in directory.iterdir() if TORCHTITAN_STEP_DIR.match(path.name) and (path / METADATA_FILE).is_file()),
        key=lambda path: int(TORCHTITAN_STEP_DIR.match(path.name)[1]),
    )


def find_torchtitan_checkpoint(local_dir: Path) -> TorchTitanCheckpoint:
    """The step's archive: `local_dir` itself (`step-N/`) or the one archive in it (`global_step_N/`).

    Raises:
        CheckpointError: no archive is there (naming the directory to pass when it is beside one), or several.
    """
    local_dir = Path(local_dir)
    archives = archives_in(local_dir)
    if len(archives) == 1:
        return TorchTitanCheckpoint(str(local_dir), str(archives[0]))
    if archives:
        raise CheckpointError(
            f"{local_dir} holds several torchtitan archives ({quoted(path.name for path in archives)}): pass one of them"
        )
    if not local_dir.exists() and not local_dir.parent.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {local_dir}")
    beside = local_dir.parent if local_dir.name in ROLE_SUBDIRS and archives_in(local_dir.parent) else None
    raise CheckpointError(
        f"not a TorchTitan checkpoint: {local_dir} holds no step-N/ archive with a {METADATA_FILE} file",
        hint=f"verl's TorchTitan engine saves the step's archive beside the role folder: pass {beside}" if beside else None,
    )


def recognises(local_dir: Path) -> bool:
    return len(archives_in(local_dir)) == 1


def is_training_file(name: str, is_dir: bool) -> bool:
    """A `step-N/` archive."""
    return is_dir and bool(TORCHTITAN_STEP_DIR.match(name))
