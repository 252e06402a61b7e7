"""Reading an FSDP checkpoint's tensors: rows of each rank's local tensor, read at their offsets in the rank
file (and checked against its CRC-32s), and the global tensor's rows assembled from the rank blocks
that hold them."""

import functools
import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

import torch

from mergeflow.errors import CheckpointError, quoted
from mergeflow.formats.fsdp.index import CORRUPT_HINT, LoadedRanks, ShardIndex, SourceTensor
from mergeflow.formats.fsdp.placement import Block
from mergeflow.formats.fsdp.rank_pickle import RankTensor
from mergeflow.formats.record_check import RecordCheck, RecordCorrupt
from mergeflow.perf import pages

ALIGNMENT = 4096
STAGING_BYTES = 16 * 1024 * 1024
DIRECT_GAP_BYTES = 1024 * 1024
"""Cached data between two uncached runs shorter than this is read from disk with them, in one request."""
BLOCK_READERS = 4
"""Rank blocks of one row range read at once, each on its own thread with its own staging buffer: the disk
serves several requests in flight faster than the same requests one after another."""

CopyRows = Callable[[Block, int, int, torch.Tensor], None]
"""`copy_rows(block, start, stop, into)`: copy rows `[start, stop)` of the block's local tensor into `into`
(casting to its dtype). Rows count from the block's first row; a 0-d tensor is copied whole."""


class FsdpSource:
    """Rows of an FSDP checkpoint's global tensors (the FSDP backend's `TensorSource`), copied from the rank
    blocks that hold them, several blocks at once."""

    def __init__(self, index: ShardIndex):
        self._index = index
        self._reader = RankReader(index.rank_files, index.loaded)
        self._pool = ThreadPoolExecutor(BLOCK_READERS, thread_name_prefix="mergeflow-block")

    def rows(self, name: str, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        source = self._index.tensors[name]
        copy_rows = self._reader.copy_rows_of(name)
        if not source.shape:
            scalar = torch.empty((), dtype=dtype)
            copy_rows(source.blocks[0], 0, 0, scalar)
            return scalar
        return assemble_rows(source, start, stop, dtype, copy_rows, self._pool)

    def verify(self) -> None:
        self._reader.verify()

    def close(self) -> None:
        self._pool.shutdown()
        self._reader.close()


def assemble_rows(
    source: SourceTensor,
    start: int,
    stop: int,
    dtype: torch.dtype,
    copy_rows: CopyRows,
    pool: ThreadPoolExecutor | None = None,
) -> torch.Tensor:
    """Rows `[start, stop)` of the global tensor, cast to `dtype`, copied from the blocks that hold them (on
    `pool`'s threads when several do)."""
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
    _copy_blocks(copy_rows, copies, pool)
    return out


def _copy_blocks(
    copy_rows: CopyRows, copies: list[tuple[Block, int, int, torch.Tensor]], pool: ThreadPoolExecutor | None
) -> None:
    """Run the copies, at once where there are several; the first error is raised once none is running."""
    if pool is None or len(copies) < 2:
        for copy in copies:
            copy_rows(*copy)
        return
    futures = [pool.submit(copy_rows, *copy) for copy in copies]
    _, pending = wait(futures, return_when=FIRST_EXCEPTION)
    for future in pending:
        future.cancel()
    wait(pending)
    for future in futures:
        if not future.cancelled() and future.exception() is not None:
            raise future.exception()


class RankReader:
    """Reads rows of the rank files' local tensors, each file opened once, into caller-given tensors.

    Rows whose pages are in the page cache (`mincore` on the mapping: a checkpoint just written or
    read) are copied straight out of the mapping, whose pages are dropped afterwards. The runs of rows
    that are not are read with O_DIRECT, in large aligned requests that skip the page cache.

    Every byte read is checked against the CRC-32 of the zip record it belongs to (`verify`, which a
    merge calls before it keeps what it wrote). Rows of different ranks can be read at the same time from
    different threads (each has its own staging buffer).
    """

    def __init__(self, rank_files: tuple[str, ...], loaded: LoadedRanks | None = None):
        self._rank_files = rank_files
        self._loaded = loaded or LoadedRanks()
        self._states: dict[int, dict[str, RankTensor]] = {}
        self._direct_fds: dict[int, int | None] = {}
        self._checks: dict[tuple[int, str], RecordCheck] = {}
        self._opening = threading.Lock()
        self._per_thread = threading.local()

    def local(self, name: str, rank: int) -> torch.Tensor:
        """The memory-mapped local tensor (its metadata is free; touching its data costs page faults)."""
        return self._tensor(name, rank).local

    def read_rows(self, name: str, rank: int, start: int, stop: int, into: torch.Tensor) -> None:
        """Copy rows `[start, stop)` of a rank's local tensor into `into`, casting to its dtype."""
        tensor = self._tensor(name, rank)
        source = tensor.local
        rows = source[start:stop] if source.dim() else source
        check = self._check(rank, tensor)
        row_bytes = source[0].numel() * source.element_size() if source.dim() else 0
        offset = tensor.file_offset + start * row_bytes if tensor.file_offset is not None else None
        direct_fd = self._direct_fds[rank]
        if offset is None or direct_fd is None or row_bytes == 0:
            _copy_mapped(rows, into, check, offset)
            return
        done = 0
        for first, last in _uncached_rows(rows, row_bytes):
            _copy_mapped(rows[done:first], into[done:first], check, offset + done * row_bytes)
            data = self._read_direct(direct_fd, rank, offset + first * row_bytes, (last - first) * row_bytes)
            if check is not None:
                check.add(offset + first * row_bytes, data.numpy())
            into[first:last].copy_(data.view(source.dtype).view(rows[first:last].shape))
            done = last
        _copy_mapped(rows[done:], into[done:], check, offset + done * row_bytes)

    def copy_rows_of(self, name: str) -> Callable[[Block, int, int, torch.Tensor], None]:
        """The `streaming.CopyRows` callable for tensor `name`: copies a block's rows from its rank."""

        def copy_rows(block: Block, start: int, stop: int, into: torch.Tensor) -> None:
            self.read_rows(name, block.rank, start, stop, into)

        return copy_rows

    def verify(self) -> None:
        """Check every record read from against its CRC-32 (reading the bytes of it no row covered).

        Raises:
            CheckpointError: a record's bytes are not the ones torch.save wrote; the error names the rank
                file and the tensors the record holds.
        """
        for (rank, key), check in sorted(self._checks.items()):
            path = self._rank_files[rank]
            try:
                with open(path, "rb") as file:
                    check.finish(functools.partial(_read_at, file))
            except RecordCorrupt as e:
                names = sorted(name for name, t in self._states[rank].items() if t.record and t.record.key == key)
                raise CheckpointError(
                    f"corrupt rank file {path}: the data of {quoted(names)} does not match its CRC-32 ({e})",
                    hint=CORRUPT_HINT,
                ) from None
        self._checks.clear()

    def _check(self, rank: int, tensor: RankTensor) -> RecordCheck | None:
        """The CRC-32 check of the record holding `tensor` (None for a compressed record, which torch.save
        never writes). A tensor whose bytes are not located in the file adds no pieces: `verify` reads its
        whole record."""
        if tensor.record is None:
            return None
        key = (rank, tensor.record.key)
        check = self._checks.get(key)
        if check is None:
            check = self._checks.setdefault(key, RecordCheck(tensor.record))
        return check

    def _tensor(self, name: str, rank: int) -> RankTensor:
        self._open(rank)
        return self._states[rank][name]

    def _read_direct(self, fd: int, rank: int, offset: int, length: int) -> torch.Tensor:
        """`length` bytes at `offset` read with O_DIRECT, as a uint8 view of the staging buffer (valid
        until the next read)."""
        start = offset - offset % ALIGNMENT
        end = -(-(offset + length) // ALIGNMENT) * ALIGNMENT
        staging = self._staging_buffer(end - start)
        view = memoryview(staging)
        try:
            _read_fully(fd, view[: end - start], start, self._rank_files[rank])
        finally:
            view.release()
        lead = offset - start
        return torch.frombuffer(staging, dtype=torch.uint8, count=lead + length)[lead:]

    def _staging_buffer(self, size: int) -> mmap.mmap:
        """This thread's staging buffer, of at least `size` bytes."""
        staging = getattr(self._per_thread, "staging", None)
        if staging is None or len(staging) < size:
            staging = self._per_thread.staging = mmap.mmap(-1, max(size, STAGING_BYTES))  # the old one unmaps once unreferenced
        return staging

    def _open(self, rank: int) -> None:
        if rank in self._states:
            return
        with self._opening:
            if rank in self._states:
                return
            path = self._rank_files[rank]
            self._direct_fds[rank] = _open_direct(path)
            self._states[rank] = self._loaded.state(path)

    def close(self) -> None:
        for fd in self._direct_fds.values():
            if fd is not None:
                os.close(fd)
        self._direct_fds.clear()
        self._states.clear()
        self._checks.clear()
        self._per_thread = threading.local()

    def __enter__(self) -> "RankReader":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _read_at(file, offset: int, length: int) -> bytes:
    file.seek(offset)
    data = file.read(length)
    if len(data) != length:
        raise RecordCorrupt(f"the file ends {length - len(data)} bytes before its record does")
    return data


def _copy_mapped(rows: torch.Tensor, into: torch.Tensor, check: RecordCheck | None, offset: int | None) -> None:
    """Copy rows out of the mapping (page faults read what is not cached), add their bytes (at `offset` of
    the file) to the record's check, then drop their pages."""
    if rows.numel():
        into.copy_(rows)
        if check is not None and offset is not None:
            check.add(offset, rows.reshape(-1).view(torch.uint8).numpy())
        pages.release(rows)


def _uncached_rows(rows: torch.Tensor, row_bytes: int) -> list[tuple[int, int]]:
    """The runs of `rows` (mapped, contiguous) with a page outside the page cache, as row ranges; runs
    separated by less than DIRECT_GAP_BYTES of cached data are joined into one read."""
    runs: list[tuple[int, int]] = []
    for start, stop in pages.uncached_ranges(rows.data_ptr(), rows.numel() * rows.element_size()):
        first, last = start // row_bytes, -(-stop // row_bytes)
        if runs and (first - runs[-1][1]) * row_bytes < DIRECT_GAP_BYTES:
            runs[-1] = (runs[-1][0], last)
        else:
            runs.append((first, last))
    return runs


def _open_direct(path: str) -> int | None:
    """An O_DIRECT descriptor, or None where the filesystem does not support it."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT)
    except (AttributeError, OSError):
        return None


def _read_fully(fd: int, view: memoryview, offset: int, path: str) -> None:
    """Fill `view` from `offset`; an aligned read may stop short at the end of the file, past the data."""
    done = 0
    while done < len(view):
        count = os.preadv(fd, [view[done:]], offset + done)
        if count == 0:
            if done == 0:
                raise OSError(f"unexpected end of {path} at byte {offset}")
            return
        done += count
