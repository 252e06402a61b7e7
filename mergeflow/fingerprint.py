"""A merge's identity without reading tensor data: the checkpoint's files by path, size and mtime, the
options that change the output, the target, and the engine version."""

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from mergeflow.output.manifest import file_listing
from mergeflow.version import __version__


@dataclass(frozen=True)
class MergeKey:
    """The cache key of one merge, and what it was computed from (for logs)."""

    digest: str
    files: int
    bytes: int


def merge_key(
    checkpoint_dirs: list[Path],
    target_dir: Path,
    options: Mapping[str, object],
    engine_version: str = __version__,
) -> MergeKey:
    """Equal keys mean the same output: same input files (unchanged by size and mtime), options, target and engine."""
    listings = {str(Path(d).absolute()): file_listing(Path(d)) for d in checkpoint_dirs}
    identity = {
        "engine": engine_version,
        "inputs": listings,
        "target": str(Path(target_dir).absolute()),
        "options": dict(sorted(options.items())),
    }
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()
    files = [entry for listing in listings.values() for entry in listing]
    return MergeKey(digest=digest, files=len(files), bytes=sum(size for _, size, _ in files))
