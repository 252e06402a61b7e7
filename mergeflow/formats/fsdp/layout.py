"""Where an FSDP checkpoint's rank files are, checked to be complete (names only: imports no torch)."""

import json
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mergeflow.errors import CheckpointError, quoted
from mergeflow.formats.verl_run import default_config_dir, wrong_level_hint

if TYPE_CHECKING:
    from mergeflow.formats.fsdp.index import ShardIndex
    from mergeflow.spec.model_spec import ModelSpec

FSDP_CONFIG_FILE = "fsdp_config.json"
RANK_FILE_PATTERN = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
TRUNCATED_HINT = "the copy or the save did not finish: copy the file again from where training saved it"


def rank_file_name(world_size: int, rank: int) -> str:
    return f"model_world_size_{world_size}_rank_{rank}.pt"


@dataclass(frozen=True)
class RankFiles:
    """The rank files of one FSDP checkpoint, checked to be complete."""

    checkpoint_dir: str
    world_size: int
    paths: tuple[str, ...]
    fsdp_version: int | None = None

    @property
    def data_files(self) -> tuple[str, ...]:
        """The files holding tensor data: the rank files themselves."""
        return self.paths

    @property
    def config_dir(self) -> str:
        return str(default_config_dir(Path(self.checkpoint_dir)))

    @property
    def model_dir(self) -> None:
        """An FSDP checkpoint always needs merging."""
        return None

    def index(self, spec: "ModelSpec | None" = None) -> "ShardIndex":
        """Every rank's tensors, from the rank files' metadata (the spec is not needed: names are stored)."""
        from mergeflow.formats.fsdp.index import index_shards

        return index_shards(self)


def detect(checkpoint_dir: Path) -> bool:
    """Whether a directory holds verl FSDP rank files."""
    return checkpoint_dir.is_dir() and any(RANK_FILE_PATTERN.match(p.name) for p in checkpoint_dir.iterdir())


def find_rank_files(checkpoint_dir: Path) -> RankFiles:
    """Find the rank files and check that ranks 0..W-1 are all there, and nothing else.

    The world size comes from `fsdp_config.json` when verl wrote one, else from the file names.

    Raises:
        CheckpointError: the directory is not an FSDP checkpoint, or its rank files are incomplete.
    """
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {checkpoint_dir}")
    found: dict[int, dict[int, Path]] = {}
    for path in sorted(checkpoint_dir.iterdir()):
        match = RANK_FILE_PATTERN.match(path.name)
        if match:
            found.setdefault(int(match[1]), {})[int(match[2])] = path
    if not found:
        raise CheckpointError(_not_a_checkpoint_message(checkpoint_dir))

    config_world_size, fsdp_version = _read_fsdp_config(checkpoint_dir)
    if config_world_size is not None:
        world_size = config_world_size
        source = f"{FSDP_CONFIG_FILE} says world_size={world_size}"
    elif len(found) == 1:
        world_size = next(iter(found))
        source = f"file names say world_size={world_size}"
    else:
        sizes = ", ".join(str(size) for size in sorted(found))
        raise CheckpointError(
            f"rank files of several world sizes ({sizes}) in {checkpoint_dir} and no {FSDP_CONFIG_FILE} to choose: "
            "remove the files of the runs you do not want to merge"
        )

    stray = sorted(
        str(path) for size, ranks in found.items() if size != world_size for path in ranks.values()
    )
    ranks = found.get(world_size, {})
    stray += sorted(str(path) for rank, path in ranks.items() if rank >= world_size)
    if stray:
        raise CheckpointError(f"unexpected rank file(s) in {checkpoint_dir} ({source}): {quoted(stray)}")
    missing = [
        checkpoint_dir / rank_file_name(world_size, rank) for rank in range(world_size) if rank not in ranks
    ]
    if missing:
        raise CheckpointError(f"rank file missing: {', '.join(map(str, missing))} ({source})")
    paths = tuple(str(ranks[rank]) for rank in range(world_size))
    for rank, path in enumerate(paths):
        _check_zip_directory(Path(path), world_size, rank, source)
    return RankFiles(str(checkpoint_dir), world_size, paths, fsdp_version)


def no_zip_directory(path: Path) -> CheckpointError:
    return CheckpointError(
        f"not a torch checkpoint: {path} is truncated or was not written by torch.save (no zip directory found)",
        hint=TRUNCATED_HINT,
    )


def _check_zip_directory(path: Path, world_size: int, rank: int, source: str) -> None:
    """A rank file must end with the zip directory `torch.save` writes last (a file cut short has none), and the
    name it was saved under, which `torch.save` records as the directory of every entry, must be this rank's of
    this world size (a file of another save renamed or copied in is not).

    Raises:
        CheckpointError: naming the file and what is wrong with it.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError) as e:
        raise no_zip_directory(path) from e
    saved_as = RANK_FILE_PATTERN.match(f"{names[0].partition('/')[0]}.pt") if names else None
    if saved_as and (int(saved_as[1]), int(saved_as[2])) != (world_size, rank):
        raise CheckpointError(
            f"{path} was saved as {saved_as[0]} (its zip directory says so), not as rank {rank} of world size "
            f"{world_size} ({source}): it belongs to another save"
        )


def _read_fsdp_config(checkpoint_dir: Path) -> tuple[int | None, int | None]:
    path = checkpoint_dir / FSDP_CONFIG_FILE
    if not path.exists():
        return None, None
    try:
        config = json.loads(path.read_text())
        world_size = int(config["world_size"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"unreadable {path}: expected JSON with an integer 'world_size' ({e})") from e
    if world_size < 1:
        raise CheckpointError(f"invalid {path}: world_size={world_size}")
    version = config.get("FSDP_version")
    return world_size, int(version) if version is not None else None


def is_training_file(name: str, is_dir: bool) -> bool:
    """A rank file or verl's `fsdp_config.json`."""
    return not is_dir and (name == FSDP_CONFIG_FILE or bool(RANK_FILE_PATTERN.match(name)))


def _not_a_checkpoint_message(directory: Path) -> str:
    message = f"not an FSDP checkpoint: {directory} has no model_world_size_*_rank_*.pt files"
    hint = wrong_level_hint(directory, detect)
    return f"{message}; {hint}" if hint else message
