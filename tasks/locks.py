"""The lock that keeps two runs off the same merge step: Prefect's file locks, written whole (holder, host and
process at once), so a holder killed with SIGKILL at any moment leaves a lock the next run can see is dead."""

import json
import os
import socket
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

from prefect.locking.filesystem import FileSystemLockManager


class ProcessAwareLockManager(FileSystemLockManager):
    """File locks that record the holding process; a lock whose process, on this host, no longer exists counts
    as released."""

    def acquire_lock(
        self, key: str, holder: str, acquire_timeout: float | None = None, hold_timeout: float | None = None
    ) -> bool:
        self._ensure_lock_files_directory_exists()
        path = Path(self._lock_path_for_key(key))
        expiration = None if hold_timeout is None else datetime.now(UTC) + timedelta(seconds=hold_timeout)
        while not self.is_lock_holder(key, holder):
            if _create_whole(path, holder, expiration):
                self._locks[key] = {"holder": holder, "expiration": expiration, "path": str(path)}
                return True
            if not self.wait_for_lock(key, acquire_timeout):
                return False
        return True

    def _get_lock_info(self, key: str, use_cache: bool = True) -> dict | None:
        """The lock's record; a file that is not one (left by an older mergeflow killed between creating and
        writing it: this one never shows a partial record) holds nothing and is removed."""
        try:
            return super()._get_lock_info(key, use_cache=use_cache)
        except ValueError:
            Path(self._lock_path_for_key(key)).unlink(missing_ok=True)
            self._locks.pop(key, None)
            return None

    def is_locked(self, key: str, use_cache: bool = False) -> bool:
        info = self._get_lock_info(key, use_cache=use_cache)
        if info is not None and _process_is_gone(info.get("host"), info.get("pid")):
            Path(info["path"]).unlink(missing_ok=True)
            self._locks.pop(key, None)
            return False
        return super().is_locked(key, use_cache=use_cache)


def _create_whole(path: Path, holder: str, expiration: datetime | None) -> bool:
    """Create the lock file at `path` with its full record in one step; False if it exists."""
    record = {
        "holder": holder,
        "expiration": None if expiration is None else str(expiration),
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }
    written = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    written.write_text(json.dumps(record))
    try:
        os.link(written, path)
    except FileExistsError:
        return False
    finally:
        written.unlink()
    return True


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
