"""Planned output tensors, read from the rank files a block of rows at a time: copied and cast, or, for
weights with a LoRA fold, computed in float32 with the LoRA added, then cast, or, for a tensor that is a
part of its source (one expert of a fused MoE tensor), copied out of the source rows it lies in.

Folding is row-local (`W[rows] += s · B[rows]·A`, DoRA's norms are per row), so it streams like a copy;
the LoRA factors themselves are small (rank × width) and read whole.
"""

import math
from collections.abc import Iterator

import torch

from mergeflow.dtypes import parse_dtype_name
from mergeflow.formats.fsdp.index import ShardIndex, SourceTensor
from mergeflow.formats.fsdp.reader import RankReader
from mergeflow.lora import LoraFold
from mergeflow.planning import OutputTensor
from mergeflow.streaming import CHUNK_BYTES, assemble_rows, row_ranges, tensor_chunks

FOLD_DTYPE = torch.float32


def output_chunks(
    tensor: OutputTensor, index: ShardIndex, reader: RankReader, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[torch.Tensor]:
    """The planned tensor's contents, as consecutive row blocks of at most about `chunk_bytes`."""
    source = index.tensors[tensor.source]
    dtype = parse_dtype_name(tensor.dtype)
    if tensor.fold is None:
        yield from tensor_chunks(source, dtype, reader.copy_rows_of(source.name), chunk_bytes)
        return
    folder = LoraFolder(tensor.fold, index, reader)
    for start, stop in row_ranges(source.shape, FOLD_DTYPE.itemsize, chunk_bytes):
        yield folder.rows(tensor, start, stop).to(dtype)


def output_rows(tensor: OutputTensor, index: ShardIndex, reader: RankReader, start: int, stop: int) -> torch.Tensor:
    """Rows `[start, stop)` of the planned tensor (a 0-d tensor whole)."""
    source = index.tensors[tensor.source]
    dtype = parse_dtype_name(tensor.dtype)
    if not source.shape:
        return next(tensor_chunks(source, dtype, reader.copy_rows_of(source.name)))
    if tensor.fold is None:
        return assemble_rows(source, start, stop, dtype, reader.copy_rows_of(source.name))
    return LoraFolder(tensor.fold, index, reader).rows(tensor, start, stop).to(dtype)


class LoraFolder:
    """One weight's LoRA factors, held in float32, added to blocks of the weight's rows."""

    def __init__(self, fold: LoraFold, index: ShardIndex, reader: RankReader):
        self._fold = fold
        self._index = index
        self._reader = reader
        lora_a, lora_b = self._whole(fold.lora_a), self._whole(fold.lora_b)
        self._left, self._right = (lora_a.T, lora_b.T) if fold.transposed else (lora_b, lora_a)
        """Rows of the delta are rows of `left` times `right`: B·A, or (B·A)ᵀ = Aᵀ·Bᵀ."""
        self._magnitude = self._whole(fold.magnitude) if fold.magnitude else None

    def _whole(self, name: str) -> torch.Tensor:
        source = self._index.tensors[name]
        return assemble_rows(source, 0, source.shape[0], FOLD_DTYPE, self._reader.copy_rows_of(name))

    def rows(self, tensor: OutputTensor, start: int, stop: int) -> torch.Tensor:
        """Rows `[start, stop)` of the folded weight, in float32."""
        source = self._index.tensors[tensor.source]
        weight = assemble_rows(source, start, stop, FOLD_DTYPE, self._reader.copy_rows_of(source.name))
        weight += self._fold.scaling * (self._left[start:stop] @ self._right)
        if self._magnitude is not None:
            weight *= (self._magnitude[start:stop] / torch.linalg.norm(weight, dim=1)).unsqueeze(1)
        return weight


class FsdpTensors:
    """Planned tensors of an FSDP checkpoint, read from its rank files."""

    def __init__(self, index: ShardIndex):
        self._index = index
        self._reader = RankReader(index.rank_files)
        self._last_piece: tuple[tuple, torch.Tensor] | None = None

    def chunks(self, tensor: OutputTensor, chunk_bytes: int = CHUNK_BYTES) -> Iterator[torch.Tensor]:
        if tensor.view is None:
            return output_chunks(tensor, self._index, self._reader, chunk_bytes)
        ranges = row_ranges(tensor.shape, parse_dtype_name(tensor.dtype).itemsize, chunk_bytes)
        return (self._viewed_rows(tensor, start, stop) for start, stop in ranges)

    def rows(self, tensor: OutputTensor, start: int, stop: int) -> torch.Tensor:
        if tensor.view is None:
            return output_rows(tensor, self._index, self._reader, start, stop)
        return self._viewed_rows(tensor, start, stop)

    def _viewed_rows(self, tensor: OutputTensor, start: int, stop: int) -> torch.Tensor:
        """Rows `[start, stop)` of a tensor that is a strided view of its source (one expert of a fused
        tensor): the source rows the view's elements lie in are read, cast, and the view copied out."""
        dtype = parse_dtype_name(tensor.dtype)
        shape = (stop - start, *tensor.shape[1:]) if tensor.shape else ()
        if math.prod(shape) == 0:
            return torch.empty(shape, dtype=dtype)
        stride = tensor.view.stride
        first = tensor.view.offset + (start * stride[0] if shape else 0)
        last = first + sum((size - 1) * step for size, step in zip(shape, stride, strict=True))
        source = self._index.tensors[tensor.source]
        row = math.prod(source.shape[1:])
        low, high = first // row, last // row + 1
        return torch.as_strided(self._piece(source, low, high, dtype), shape, stride, first - low * row).contiguous()

    def _piece(self, source: SourceTensor, low: int, high: int, dtype: torch.dtype) -> torch.Tensor:
        """Source rows `[low, high)` in `dtype`; the last piece is kept, as consecutive tensors (one
        expert's gate and up projections) are views of the same rows."""
        key = (source.name, low, high, dtype)
        if self._last_piece is None or self._last_piece[0] != key:
            self._last_piece = None
            rows = assemble_rows(source, low, high, dtype, self._reader.copy_rows_of(source.name))
            self._last_piece = (key, rows)
        return self._last_piece[1]

    def verify(self) -> None:
        """Check what was read against the rank files' CRC-32s (`RankReader.verify`)."""
        self._reader.verify()

    def close(self) -> None:
        self._last_piece = None
        self._reader.close()


def open_tensors(index):
    """The reader of planned tensors for the checkpoint's backend (FSDP rank files or a Megatron archive)."""
    from mergeflow.formats.megatron.index import MegatronIndex, MegatronTensors

    return MegatronTensors(index) if isinstance(index, MegatronIndex) else FsdpTensors(index)
