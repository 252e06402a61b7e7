"""Assemble a global tensor from its rank blocks, a bounded block of rows at a time."""

from collections.abc import Callable, Iterator

import torch

from mergeflow.fsdp import SourceTensor
from mergeflow.placement import Block

CHUNK_BYTES = 64 * 1024 * 1024

BlockReader = Callable[[Block], torch.Tensor]
"""Returns the local tensor a block's rank holds for the tensor being assembled."""


def row_ranges(
    shape: tuple[int, ...], itemsize: int, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[tuple[int, int]]:
    """Split dim 0 into `[start, stop)` ranges of at most `chunk_bytes` (at least one row each)."""
    if not shape or shape[0] == 0:
        yield 0, 0
        return
    row_bytes = itemsize
    for size in shape[1:]:
        row_bytes *= size
    rows = max(1, chunk_bytes // max(row_bytes, 1))
    for start in range(0, shape[0], rows):
        yield start, min(start + rows, shape[0])


def tensor_chunks(
    source: SourceTensor, dtype: torch.dtype, read_block: BlockReader, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[torch.Tensor]:
    """The tensor's contents in `dtype`, as consecutive row blocks of the global tensor."""
    if not source.shape:
        yield read_block(source.blocks[0]).to(dtype)
        return
    for start, stop in row_ranges(source.shape, dtype.itemsize, chunk_bytes):
        yield assemble_rows(source, start, stop, dtype, read_block)


def assemble_rows(
    source: SourceTensor, start: int, stop: int, dtype: torch.dtype, read_block: BlockReader
) -> torch.Tensor:
    """Rows `[start, stop)` of the global tensor, cast to `dtype`, copied from the blocks that hold them."""
    out = torch.empty((stop - start, *source.shape[1:]), dtype=dtype)
    for block in source.blocks:
        first_row, rows = block.offset[0], block.shape[0]
        low, high = max(start, first_row), min(stop, first_row + rows)
        if low >= high:
            continue
        target = out[low - start : high - start]
        for dim in range(1, len(source.shape)):
            target = target.narrow(dim, block.offset[dim], block.shape[dim])
        target.copy_(read_block(block)[low - first_row : high - first_row])
    return out
