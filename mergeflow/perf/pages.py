"""Page-level views of memory-mapped shards: which of their pages are in the page cache (`mincore`), and
dropping them from the process once copied (so RSS stays flat however large the model)."""

import ctypes
import ctypes.util
import mmap
import re
import sys

import torch

MADV_DONTNEED = 4
PAGE_SIZE = mmap.PAGESIZE
_ABSENT_PAGES = bytes(0 if flags & 1 else 1 for flags in range(256))
"""Maps each `mincore` residency byte to 1 where the page is not resident."""

_libc = (
    ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if sys.platform.startswith("linux") else None
)


def _advise(tensor: torch.Tensor, advice: int) -> None:
    if _libc is None or tensor.numel() == 0 or not tensor.is_contiguous():
        return
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    aligned = start - start % PAGE_SIZE
    _libc.madvise(ctypes.c_void_p(aligned), ctypes.c_size_t(end - aligned), ctypes.c_int(advice))


def in_page_cache(address: int, length: int) -> bool:
    """Whether every page of the mapped range `[address, address + length)` is in the page cache."""
    return length > 0 and not uncached_ranges(address, length)


def uncached_ranges(address: int, length: int) -> list[tuple[int, int]]:
    """The byte ranges of the mapped range `[address, address + length)` whose pages are not in the page
    cache, as `(start, stop)` offsets from `address` (clipped to the range); all of it where `mincore`
    cannot tell."""
    if length <= 0:
        return []
    if _libc is None:
        return [(0, length)]
    aligned = address - address % PAGE_SIZE
    span = address + length - aligned
    residency = (ctypes.c_ubyte * (-(-span // PAGE_SIZE)))()
    if _libc.mincore(ctypes.c_void_p(aligned), ctypes.c_size_t(span), residency) != 0:
        return [(0, length)]
    lead = address - aligned
    absent = bytes(residency).translate(_ABSENT_PAGES)
    return [
        (max(match.start() * PAGE_SIZE - lead, 0), min(match.end() * PAGE_SIZE - lead, length))
        for match in re.finditer(rb"\x01+", absent)
    ]


def release(tensor: torch.Tensor) -> None:
    """Drop a memory-mapped tensor's pages from this process (the page cache keeps them)."""
    _advise(tensor, MADV_DONTNEED)
