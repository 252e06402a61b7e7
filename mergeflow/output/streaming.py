"""Streaming a tensor a bounded block of rows at a time, with the blocks produced ahead of their writer."""

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import TypeVar

CHUNK_BYTES = 32 * 1024 * 1024
PREFETCH_DEPTH = 2

Item = TypeVar("Item")


def row_ranges(
    shape: tuple[int, ...], itemsize: int, chunk_bytes: int = CHUNK_BYTES
) -> list[tuple[int, int]]:
    """Split dim 0 into `[start, stop)` ranges of at most `chunk_bytes` (at least one row each); a 0-d or
    empty tensor is one range `(0, 0)`."""
    if not shape or shape[0] == 0:
        return [(0, 0)]
    row_bytes = itemsize
    for size in shape[1:]:
        row_bytes *= size
    rows = max(1, chunk_bytes // max(row_bytes, 1))
    return [(start, min(start + rows, shape[0])) for start in range(0, shape[0], rows)]


def prefetched(items: Iterable[Item], depth: int = PREFETCH_DEPTH) -> Iterator[Item]:
    """Produce `items` on a background thread, at most `depth` ahead of the consumer.

    Reading and casting (preads and torch, which release the GIL) then overlap with the consumer's
    writes. An exception in the producer is raised in the consumer; a consumer that stops early
    stops the producer.
    """
    buffer: queue.Queue = queue.Queue(maxsize=depth)
    done = object()
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                if not _put(buffer, (None, item), stop):
                    return
            _put(buffer, (None, done), stop)
        except BaseException as error:
            _put(buffer, (error, None), stop)

    producer = threading.Thread(target=produce, name="mergeflow-prefetch", daemon=True)
    producer.start()
    try:
        while True:
            error, item = buffer.get()
            if error is not None:
                raise error
            if item is done:
                return
            yield item
    finally:
        stop.set()
        producer.join()


def _put(buffer: queue.Queue, entry: tuple, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            buffer.put(entry, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False
