"""Assemble global tensors from their rank blocks, a bounded block of rows at a time, ahead of the writer.

Memory stays bounded by the chunk size times the prefetch depth, whatever the model or tensor size.
The blocks of one row range (one per rank, in an FSDP checkpoint) are read concurrently: the disk
serves several requests in flight faster than the same requests one after another, with a cast
between each.
"""

import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import TypeVar

import torch

from mergeflow.formats.fsdp.index import SourceTensor
from mergeflow.formats.fsdp.placement import Block

CHUNK_BYTES = 32 * 1024 * 1024
PREFETCH_DEPTH = 2
BLOCK_READERS = 4
"""Blocks read at once; each reader thread holds one read buffer."""

CopyRows = Callable[[Block, int, int, torch.Tensor], None]
"""`copy_rows(block, start, stop, into)`: copy rows `[start, stop)` of the block's local tensor into `into`
(casting to its dtype). Rows count from the block's first row; a 0-d tensor is copied whole. Calls for
different blocks may run at the same time, on different threads."""

Item = TypeVar("Item")


def row_ranges(
    shape: tuple[int, ...], itemsize: int, chunk_bytes: int = CHUNK_BYTES
) -> list[tuple[int, int]]:
    """Split dim 0 into `[start, stop)` ranges of at most `chunk_bytes` (at least one row each)."""
    if not shape or shape[0] == 0:
        return [(0, 0)]
    row_bytes = itemsize
    for size in shape[1:]:
        row_bytes *= size
    rows = max(1, chunk_bytes // max(row_bytes, 1))
    return [(start, min(start + rows, shape[0])) for start in range(0, shape[0], rows)]


def tensor_chunks(
    source: SourceTensor, dtype: torch.dtype, copy_rows: CopyRows, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[torch.Tensor]:
    """The tensor's contents in `dtype`, as consecutive row blocks of the global tensor."""
    if not source.shape:
        scalar = torch.empty((), dtype=dtype)
        copy_rows(source.blocks[0], 0, 0, scalar)
        yield scalar
        return
    for start, stop in row_ranges(source.shape, dtype.itemsize, chunk_bytes):
        yield assemble_rows(source, start, stop, dtype, copy_rows)


def assemble_rows(
    source: SourceTensor, start: int, stop: int, dtype: torch.dtype, copy_rows: CopyRows
) -> torch.Tensor:
    """Rows `[start, stop)` of the global tensor, cast to `dtype`, copied from the blocks that hold them."""
    out = torch.empty((stop - start, *source.shape[1:]), dtype=dtype)
    copies = []
    for block in source.blocks:
        first_row, rows = block.offset[0], block.shape[0]
        low, high = max(start, first_row), min(stop, first_row + rows)
        if low >= high:
            continue
        target = out[low - start : high - start]
        for dim in range(1, len(source.shape)):
            target = target.narrow(dim, block.offset[dim], block.shape[dim])
        copies.append((block, low - first_row, high - first_row, target))
    _copy_blocks(copy_rows, copies)
    return out


def _copy_blocks(copy_rows: CopyRows, copies: list[tuple[Block, int, int, torch.Tensor]]) -> None:
    """Run the copies, several at once when there are several; the first error is raised once none is running."""
    if len(copies) < 2:
        for copy in copies:
            copy_rows(*copy)
        return
    futures = [_block_pool().submit(copy_rows, *copy) for copy in copies]
    _, pending = wait(futures, return_when=FIRST_EXCEPTION)
    for future in pending:
        future.cancel()
    wait(pending)
    for future in futures:
        if not future.cancelled() and future.exception() is not None:
            raise future.exception()


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _forget_pool() -> None:
    """In a forked child the parent's pool threads do not exist: start a new pool there."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def _block_pool() -> ThreadPoolExecutor:
    """The process's block-reader threads, started on first use (idle threads cost nothing)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(BLOCK_READERS, thread_name_prefix="mergeflow-block")
        return _pool


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
