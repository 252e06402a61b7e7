"""What a merge wrote, as a small manifest (paths, sizes, mtimes), and whether a folder still holds it."""

import os
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class ShardWritten:
    """One safetensors file in the output, and whether an earlier, interrupted run had already written it."""

    name: str
    size: int
    resumed: bool = False
    """Found finished in the output folder (written ahead before the flow reached it, or by an interrupted run)."""
    written_ahead_for: int | None = None
    """The process id of the command whose write-ahead child wrote it (`mergeflow.write_ahead`), if one did."""
    fp8_errors: dict[str, float] = field(default_factory=dict)
    """Each FP8 weight's largest relative rounding error against the tensor it was quantized from."""
    fp8_outside: tuple[str, ...] = ()
    """FP8 weights with an element outside the rounding bound (none, when quantization is right)."""


def how_written(shard: ShardWritten) -> str:
    """Where a weight file of the staging folder came from, as the log says it (in the process that runs the flow)."""
    if not shard.resumed:
        return "written"
    if shard.written_ahead_for == os.getpid():
        return "written ahead while Prefect started"
    if shard.written_ahead_for is not None:
        return f"written ahead by an earlier mergeflow command (process {shard.written_ahead_for}), kept"
    return "kept from an interrupted run of this merge"


@dataclass(frozen=True)
class OutputFile:
    name: str
    """The path relative to the model folder."""
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class SavedModel:
    """A small manifest of what a merge wrote (no tensors)."""

    folder: str
    """Where the files are: the staging folder until the model is published, then the target (`published`)."""
    files: tuple[OutputFile, ...]
    """Every file written, by its path relative to `folder`."""
    weight_files: tuple[str, ...]
    total_size: int
    num_tensors: int
    dtype: str
    seconds: float
    adapter_dir: str | None = None
    validation: str = ""
    """The validation verdict the folder was published with."""
    fp8_errors: dict[str, float] = field(default_factory=dict)
    """For an FP8 model: each quantized weight's largest relative rounding error against its source."""
    fp8_outside: tuple[str, ...] = ()
    """FP8 weights with an element outside the rounding bound of their source."""
    published: bool = False
    """`folder` is the target, renamed into place after validation."""
    up_to_date: bool = False
    """The run that returned it found this merge's output in place and wrote nothing (a cache hit)."""


def file_listing(directory: Path) -> list[tuple[str, int, int]]:
    """Every file under `directory` as (relative path, size, mtime in ns), sorted; only `stat` is called."""
    listing = []
    for root, dirs, names in os.walk(directory):
        dirs.sort()
        for name in names:
            path = os.path.join(root, name)
            stat = os.stat(path)
            listing.append((os.path.relpath(path, directory), stat.st_size, stat.st_mtime_ns))
    return sorted(listing)


def describe_files(folder: Path) -> tuple[OutputFile, ...]:
    """Every file under `folder`."""
    return tuple(OutputFile(name, size, mtime_ns) for name, size, mtime_ns in file_listing(Path(folder)))


def output_intact(saved: SavedModel) -> bool:
    """Whether `saved.folder` holds exactly the files the manifest lists, unchanged (by size and mtime)."""
    folder = Path(saved.folder)
    recorded = sorted((file.name, file.size, file.mtime_ns) for file in saved.files)
    return folder.is_dir() and file_listing(folder) == recorded
