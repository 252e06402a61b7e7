"""Caching of merged state: a merge is keyed by its `MergeKey`, runs once at a time per key, and its
cached value is the output manifest."""

import json
import os
import socket
from pathlib import Path

from prefect.cache_policies import CacheKeyFnPolicy
from prefect.locking.filesystem import FileSystemLockManager
from prefect.results import get_result_store
from prefect.settings import get_current_settings

from mergeflow.output.manifest import SavedModel


class ProcessAwareLockManager(FileSystemLockManager):
    """File locks that also record the holding process; a lock whose process, on this host, no longer
    exists counts as released: a merge killed with SIGKILL must not block the next run of the same merge."""

    def acquire_lock(
        self, key: str, holder: str, acquire_timeout: float | None = None, hold_timeout: float | None = None
    ) -> bool:
        acquired = super().acquire_lock(key, holder, acquire_timeout, hold_timeout)
        if acquired:
            path = Path(self._lock_path_for_key(key))
            info = json.loads(path.read_text())
            info.update(host=socket.gethostname(), pid=os.getpid())
            path.write_text(json.dumps(info))
        return acquired

    def is_locked(self, key: str, use_cache: bool = False) -> bool:
        try:
            info = self._get_lock_info(key, use_cache=use_cache)
        except ValueError:  # another process is writing the lock file: it is held
            return True
        if info is not None and _process_is_gone(info.get("host"), info.get("pid")):
            Path(info["path"]).unlink(missing_ok=True)
            self._locks.pop(key, None)
            return False
        return super().is_locked(key, use_cache=use_cache)


def _process_is_gone(host: str | None, pid: int | None) -> bool:
    if host != socket.gethostname() or pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def lock_directory() -> Path:
    return Path(get_current_settings().home) / "mergeflow" / "locks"


def merge_key_of(_context, parameters: dict) -> str:
    return parameters["key"].digest


MERGE_CACHE = CacheKeyFnPolicy(cache_key_fn=merge_key_of).configure(
    lock_manager=ProcessAwareLockManager(lock_files_directory=lock_directory()),
    isolation_level="SERIALIZABLE",
)
"""One merge per key at a time, across processes on this host; a second run waits, then reads the manifest."""


def recorded_merge(task, digest: str) -> SavedModel | None:
    """The manifest `task` cached under `digest`, if any (waiting while a run of the same merge holds its lock).

    Records are JSON (the task's result serializer), never pickles.
    """
    store = get_result_store().update_for_task(task)
    if not store.exists(digest):
        return None
    return store.read(digest).result
