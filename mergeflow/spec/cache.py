"""Model specs remembered on disk, keyed by everything they are derived from.

Every checkpoint of a training run has the same config, so a spec is stored once per (config.json,
remote-code files, transformers version, options) and read back on the next merge without importing
transformers. `MERGEFLOW_CACHE_DIR` moves the cache (default: `$XDG_CACHE_HOME/mergeflow` or
`~/.cache/mergeflow`); an unreadable or stale entry is rebuilt. Builders of the same entry, in this
process or another, take turns on a file lock, so a spec is built once.
"""

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from mergeflow.spec.config_files import require_config

CACHE_DIR_VARIABLE = "MERGEFLOW_CACHE_DIR"
SPEC_SUBDIR = "model-specs"
LOCK_SUBDIR = "locks"
FORMAT_VERSION = 3
"""Bumped whenever the stored fields or the way they are derived change."""


def cache_dir() -> Path:
    if os.environ.get(CACHE_DIR_VARIABLE):
        return Path(os.environ[CACHE_DIR_VARIABLE])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mergeflow"


def spec_key(config_dir: Path, options: dict[str, Any]) -> str:
    """A digest of config.json, the directory's Python files (remote code), transformers' version and options.

    Raises:
        CheckpointError: the directory has no config.json (`require_config`).
    """
    config = require_config(config_dir)
    digest = hashlib.sha256()
    digest.update(json.dumps({"format": FORMAT_VERSION, "transformers": _transformers_version(), **options},
                             sort_keys=True).encode())
    for path in [config, *sorted(config_dir.glob("*.py"))]:
        digest.update(path.name.encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


def model_spec_key(config_dir: Path, *, trust_remote_code: bool, is_value_model: bool) -> str:
    """The key of a model spec built with these options."""
    return spec_key(config_dir, {"trust_remote_code": trust_remote_code, "is_value_model": is_value_model})


def is_stored(key: str) -> bool:
    """Whether an entry is stored under `key` (read without building anything)."""
    return _stored_fields(_entry_path(key), ()) is not None


def open_build_lock(key: str) -> BinaryIO:
    """The file whose lock a builder of entry `key` holds (open, not locked yet)."""
    path = cache_dir() / LOCK_SUBDIR / f"{key}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    return open(path, "ab")


@contextlib.contextmanager
def _turn_to_build(key: str) -> Iterator[None]:
    """Hold the build lock of entry `key` (waiting while another builder holds it); where the cache cannot
    be written, build without taking turns."""
    try:
        lock = open_build_lock(key)
    except OSError:
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def cached_fields(key: str, build: Callable[[], dict[str, Any]], required: Iterable[str] = ()) -> dict[str, Any]:
    """The stored JSON fields under `key`, or `build()`'s, which are then stored (best effort, atomically).

    A build of the same entry under way elsewhere (another thread, the child a `SpecBuild` started) is
    waited for, not repeated. An entry that is not a JSON object holding every `required` field is treated
    as absent.
    """
    path, required = _entry_path(key), tuple(required)
    stored = _stored_fields(path, required)
    if stored is not None:
        return stored
    with _turn_to_build(key):
        stored = _stored_fields(path, required)
        if stored is not None:
            return stored
        fields = build()
        store(key, fields)
    return fields


def store(key: str, fields: dict[str, Any]) -> None:
    """Store an entry (atomically, best effort: a cache that cannot be written is skipped)."""
    _store(_entry_path(key), fields)


def _entry_path(key: str) -> Path:
    return cache_dir() / SPEC_SUBDIR / f"{key}.json"


def _stored_fields(path: Path, required: tuple[str, ...]) -> dict[str, Any] | None:
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if isinstance(stored, dict) and all(field in stored for field in required):
        return stored
    return None


def _store(path: Path, fields: dict[str, Any]) -> None:
    """Write the entry atomically; a cache that cannot be written (read-only home, full disk) is skipped."""
    temporary: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as file:
            temporary = Path(file.name)
            json.dump(fields, file)
        os.replace(temporary, path)
    except OSError:
        if temporary is not None:
            with contextlib.suppress(OSError):
                temporary.unlink()


def _transformers_version() -> str:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "none"
