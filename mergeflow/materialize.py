"""Planned output tensors, read from the rank files a block of rows at a time: copied and cast, or, for
weights with a LoRA fold, computed in float32 with the LoRA added, then cast.

Folding is row-local (`W[rows] += s · B[rows]·A`, DoRA's norms are per row), so it streams like a copy;
the LoRA factors themselves are small (rank × width) and read whole.
"""

from collections.abc import Iterator

import torch

from mergeflow.dtypes import parse_dtype_name
from mergeflow.fsdp import ShardIndex
from mergeflow.lora import LoraFold
from mergeflow.planning import OutputTensor
from mergeflow.rank_reader import RankReader
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

    def chunks(self, tensor: OutputTensor, chunk_bytes: int = CHUNK_BYTES) -> Iterator[torch.Tensor]:
        return output_chunks(tensor, self._index, self._reader, chunk_bytes)

    def rows(self, tensor: OutputTensor, start: int, stop: int) -> torch.Tensor:
        return output_rows(tensor, self._index, self._reader, start, stop)

    def close(self) -> None:
        self._reader.close()


def open_tensors(index):
    """The reader of planned tensors for the checkpoint's backend (FSDP rank files or a Megatron archive)."""
    from mergeflow.megatron import MegatronIndex, MegatronTensors

    return MegatronTensors(index) if isinstance(index, MegatronIndex) else FsdpTensors(index)
