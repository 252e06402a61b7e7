"""What a merge wrote, as a small manifest (paths, sizes, hashes, mtimes), and whether a folder still holds it."""

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

HASH_BLOCK_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class OutputFile:
    name: str
    """The path relative to the model folder."""
    size: int
    sha256: str
    mtime_ns: int


@dataclass(frozen=True)
class SavedModel:
    """A small manifest of what a merge wrote (no tensors)."""

    target_dir: str
    files: tuple[OutputFile, ...]
    """Every file written, by its path relative to `target_dir`."""
    weight_files: tuple[str, ...]
    total_size: int
    num_tensors: int
    dtype: str
    seconds: float
    adapter_dir: str | None = None


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(HASH_BLOCK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def describe_files(folder: Path, known_sha256: dict[str, str]) -> tuple[OutputFile, ...]:
    """Every file under `folder`, hashing those whose digest `known_sha256` (by relative path) does not give."""
    described = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        name = str(path.relative_to(folder))
        stat = path.stat()
        sha256 = known_sha256.get(name) or sha256_of(path)
        described.append(OutputFile(name, stat.st_size, sha256, stat.st_mtime_ns))
    return tuple(described)


def output_intact(saved: SavedModel) -> bool:
    """Whether `saved.target_dir` holds exactly the files the manifest lists, unchanged (by size and mtime)."""
    folder = Path(saved.target_dir)
    if not folder.is_dir():
        return False
    expected = {f.name: f for f in saved.files}
    found = 0
    for root, _, names in os.walk(folder):
        for name in names:
            relative = os.path.relpath(os.path.join(root, name), folder)
            record = expected.get(relative)
            if record is None:
                return False
            stat = os.stat(os.path.join(root, name))
            if (stat.st_size, stat.st_mtime_ns) != (record.size, record.mtime_ns):
                return False
            found += 1
    return found == len(expected)
