"""Have the kernel read a checkpoint's files into the page cache while the merge is busy elsewhere (importing
torch, building a spec), so that its own reads later find them there.

Where the file's block device says how much one readahead request may cover (`read_ahead_kb`,
`max_sectors_kb` in sysfs), the files are hinted in requests of that size (POSIX_FADV_WILLNEED): the
kernel reads them asynchronously, many requests in flight, and copies nothing to this process.
Elsewhere, background threads read the files through one small reused buffer each, two files at a
time. It is only a hint: what is not read ahead, or is evicted before it is needed, is read from disk.
"""

import mmap
import os
import threading
from collections.abc import Sequence
from pathlib import Path

REQUEST_BYTES = 16 * 1024 * 1024
"""One read: long enough that waiting for the GIL between reads costs little, short enough to stop promptly."""
MIN_HINT_BYTES = 256 * 1024
"""Hints smaller than this cost more in system calls than they save: read instead."""
STREAMS = 2
"""Files read at once, each by its own thread."""
MEMORY_SHARE = 4
"""Read ahead at most 1/MEMORY_SHARE of physical memory, so the cache never pushes out what it holds."""


class ReadAhead:
    """A background read of a list of files, each from its start, until stopped or out of budget; STREAMS
    threads share the files out (every STREAMS-th to each) and the budget."""

    def __init__(self, paths: Sequence[str]):
        self.paths = tuple(paths)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> "ReadAhead":
        """Start reading (a second call while it runs does nothing)."""
        if not self.running:
            self._stop.clear()
            streams = max(1, min(STREAMS, len(self.paths)))
            self._threads = [
                threading.Thread(
                    target=_read_ahead,
                    args=(self.paths[first::streams], _budget_bytes() // streams, self._stop),
                    name="mergeflow-read-ahead",
                    daemon=True,
                )
                for first in range(streams)
            ]
            for thread in self._threads:
                thread.start()
        return self

    @property
    def running(self) -> bool:
        return any(thread.is_alive() for thread in self._threads)

    def stop(self) -> None:
        """End it now: the merge reads the files for itself from here on (hints still queued would hold its
        reads up and read the same blocks twice)."""
        self._stop.set()
        for thread in self._threads:
            thread.join()


def _read_ahead(paths: tuple[str, ...], budget: int, stop: threading.Event) -> None:
    buffer = mmap.mmap(-1, REQUEST_BYTES)
    view = memoryview(buffer)
    try:
        for path in paths:
            budget = _read_file(path, view, budget, stop)
            if stop.is_set() or budget <= 0:
                return
    finally:
        view.release()
        buffer.close()


def _read_file(path: str, view: memoryview, budget: int, stop: threading.Event) -> int:
    """Bring `path` into the page cache from its start until the end, `stop` or the budget; returns the
    budget left."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return budget
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        hint_bytes = _hint_bytes(fd)
        if hint_bytes >= MIN_HINT_BYTES:
            return _hint_file(fd, hint_bytes, budget, stop)
        return _read_through(fd, view, budget, stop)
    except OSError:
        return budget
    finally:
        os.close(fd)


def _hint_file(fd: int, hint_bytes: int, budget: int, stop: threading.Event) -> int:
    """Ask the kernel to read the file ahead, `hint_bytes` per request (it returns once they are queued)."""
    size = os.fstat(fd).st_size
    offset = 0
    while offset < size and not stop.is_set() and budget > 0:
        os.posix_fadvise(fd, offset, hint_bytes, os.POSIX_FADV_WILLNEED)
        offset += hint_bytes
        budget -= hint_bytes
    return budget


def _read_through(fd: int, view: memoryview, budget: int, stop: threading.Event) -> int:
    offset = 0
    while not stop.is_set() and budget > 0:
        count = os.preadv(fd, [view], offset)
        if count == 0:
            break
        offset += count
        budget -= count
    return budget


def _hint_bytes(fd: int) -> int:
    """The most one POSIX_FADV_WILLNEED request reads of this file (after POSIX_FADV_SEQUENTIAL, which
    doubles the readahead window): the larger of the device's largest request and that window, as Linux
    caps it; 0 where the file's device does not say (no sysfs, not a block device)."""
    device = os.fstat(fd).st_dev
    block = Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}").resolve()  # a partition: queue/ is its disk's
    queue = block / "queue" if (block / "queue").is_dir() else block.parent / "queue"
    try:
        window_kb = int((queue / "read_ahead_kb").read_text())
        request_kb = int((queue / "max_sectors_kb").read_text())
    except (OSError, ValueError):
        return 0
    return min(max(request_kb, 2 * window_kb) * 1024, REQUEST_BYTES)


def _budget_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // MEMORY_SHARE
    except (AttributeError, OSError, ValueError):
        return 0
