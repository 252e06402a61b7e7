"""The file names of a PyTorch Distributed Checkpoint (DCP) archive, which Megatron's `torch_dist` format and
torchtitan save (names only: imports no torch)."""

import re
from pathlib import Path

METADATA_FILE = ".metadata"
"""Written last, after every data file: an archive without it is not complete."""
DATA_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")


def data_files(archive_dir: str | Path) -> tuple[str, ...]:
    """The archive's data files (`__R_K.distcp`), sorted."""
    return tuple(sorted(str(path) for path in Path(archive_dir).iterdir() if DATA_FILE.match(path.name)))


def writer_ranks(archive_dir: str | Path) -> int:
    """How many ranks wrote the archive (the distinct R of its data files; 1 when it has none)."""
    return len({DATA_FILE.match(Path(path).name)[1] for path in data_files(archive_dir)}) or 1
