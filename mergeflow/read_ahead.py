"""Have the kernel read checkpoint files into the page cache while the merge is still being planned.

Building the model spec for a config not seen before is seconds of CPU (importing transformers, building
the model on the meta device) with the disk idle. `read_ahead` uses that time: a background thread reads
the files through the page cache into one small reused buffer, so only that buffer counts against RSS.
(POSIX_FADV_WILLNEED would copy nothing, but the kernel caps each request at the device's readahead
window, often 128 KiB: too small to keep the disk busy from a thread that waits for the GIL between
requests.) The rank reader later finds those pages cached and copies them from its mapping instead of
reading them from disk again. It is only a hint: what is not read ahead, or is evicted before it is
needed, is read from disk as before.
"""

import mmap
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

REQUEST_BYTES = 32 * 1024 * 1024
"""One read: long enough that waiting for the GIL between reads costs little, short enough to stop promptly."""
MEMORY_SHARE = 4
"""Read ahead at most 1/MEMORY_SHARE of physical memory, so the cache never pushes out what it holds."""


class _Reader:
    """One background read of a list of files, from their start, until stopped or out of budget."""

    def __init__(self, paths: tuple[str, ...]):
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=_read_ahead, args=(paths, _budget_bytes(), self._stop), name="mergeflow-read-ahead", daemon=True
        )
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


_readers: dict[tuple[str, ...], _Reader] = {}
"""Read-aheads `start_read_ahead` began, waiting for the `read_ahead` block that ends them."""
_readers_lock = threading.Lock()


def start_read_ahead(paths: Sequence[str]) -> None:
    """Start reading `paths` into the page cache in the background, before the merge is ready to plan.

    The read goes on until a `read_ahead` block of the same paths ends (or the budget is spent), so it
    can start first thing, while the process is still importing libraries; a second call while it runs
    does nothing.
    """
    key = tuple(paths)
    with _readers_lock:
        if key not in _readers or not _readers[key].running:
            _readers[key] = _Reader(key)


@contextmanager
def read_ahead(paths: Sequence[str]) -> Iterator[None]:
    """Read `paths`, one after another from their start, into the page cache while the block runs.

    A read-ahead `start_read_ahead` began for the same paths is carried on (not restarted) and ends with the block.
    """
    key = tuple(paths)
    with _readers_lock:
        reader = _readers.pop(key, None) or _Reader(key)
    try:
        yield
    finally:
        reader.stop()


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
    """Read `path` from its start until the end, `stop` or the budget; returns the budget left."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return budget
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        offset = 0
        while not stop.is_set() and budget > 0:
            count = os.preadv(fd, [view], offset)
            if count == 0:
                break
            offset += count
            budget -= count
    except OSError:
        pass
    finally:
        os.close(fd)
    return budget


def _budget_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // MEMORY_SHARE
    except (AttributeError, OSError, ValueError):
        return 0
