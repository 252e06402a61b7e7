"""Model specs remembered on disk, keyed by everything they are derived from.

Building a spec imports transformers and the model's modeling code and builds it on the meta device:
seconds, on every merge. Every checkpoint of a training run has the same config, so a spec is stored
once per (config.json, remote-code files, transformers version, options) and read back on the next
merge without importing transformers at all. `MERGEFLOW_CACHE_DIR` moves the cache (default:
`$XDG_CACHE_HOME/mergeflow` or `~/.cache/mergeflow`); an unreadable or stale entry is rebuilt.
"""

import contextlib
import hashlib
import importlib.metadata
import json
import os
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

CACHE_DIR_VARIABLE = "MERGEFLOW_CACHE_DIR"
SPEC_SUBDIR = "model-specs"
FORMAT_VERSION = 2
"""Bumped whenever the stored fields or the way they are derived change."""

_builder_locks: dict[str, threading.Lock] = {}
_builds_elsewhere: dict[str, Callable[[], object]] = {}
_builder_locks_guard = threading.Lock()


def cache_dir() -> Path:
    if os.environ.get(CACHE_DIR_VARIABLE):
        return Path(os.environ[CACHE_DIR_VARIABLE])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mergeflow"


def spec_key(config_dir: Path, options: dict[str, Any]) -> str:
    """A digest of config.json, the directory's Python files (remote code), transformers' version and options."""
    digest = hashlib.sha256()
    digest.update(json.dumps({"format": FORMAT_VERSION, "transformers": _transformers_version(), **options},
                             sort_keys=True).encode())
    for path in [config_dir / "config.json", *sorted(config_dir.glob("*.py"))]:
        digest.update(path.name.encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


def model_spec_key(config_dir: Path, *, trust_remote_code: bool, is_value_model: bool) -> str:
    """The key of a model spec built with these options."""
    return spec_key(config_dir, {"trust_remote_code": trust_remote_code, "is_value_model": is_value_model})


def is_stored(key: str) -> bool:
    """Whether an entry is stored under `key` (read without building anything)."""
    return _stored_fields(cache_dir() / SPEC_SUBDIR / f"{key}.json", ()) is not None


def build_elsewhere(key: str, wait: Callable[[], object]) -> None:
    """Note that another process is building the entry `key`: a lookup that misses it calls `wait` and
    looks again before building it a second time."""
    _builds_elsewhere[key] = wait


def built_elsewhere(key: str) -> None:
    """The build noted by `build_elsewhere` has ended (stored or not)."""
    _builds_elsewhere.pop(key, None)


def cached_fields(key: str, build: Callable[[], dict[str, Any]], required: Iterable[str] = ()) -> dict[str, Any]:
    """The stored JSON fields under `key`, or `build()`'s, which are then stored (best effort, atomically).

    An entry that is not a JSON object holding every `required` field is treated as absent.
    """
    path = cache_dir() / SPEC_SUBDIR / f"{key}.json"
    required = tuple(required)
    stored = _stored_fields(path, required)
    wait = _builds_elsewhere.get(key)
    if stored is None and wait is not None:
        wait()
        stored = _stored_fields(path, required)
    if stored is not None:
        return stored
    with _builder_lock(key):
        stored = _stored_fields(path, required)
        if stored is not None:
            return stored
        fields = build()
        _store(path, fields)
    return fields


def _stored_fields(path: Path, required: tuple[str, ...]) -> dict[str, Any] | None:
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if isinstance(stored, dict) and all(field in stored for field in required):
        return stored
    return None


def _builder_lock(key: str) -> threading.Lock:
    """One lock per key: threads asking for the same spec at once (a warm-up and the flow) build it once."""
    with _builder_locks_guard:
        return _builder_locks.setdefault(key, threading.Lock())


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
