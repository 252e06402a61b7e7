"""The tensors a merge plan writes, read from the checkpoint a block of rows at a time, whatever its backend:
copied and cast; or, for weights with a LoRA fold, computed in float32 with the LoRA added, then cast; or,
for a tensor that is a part of its source (one expert of a fused MoE tensor), cut out of the source rows
it lies in.

Folding is row-local (`W[rows] += s · B[rows]·A`, DoRA's norms are per row), so it streams like a copy;
the LoRA factors themselves are small (rank × width) and read whole. FP8 quantization is local to blocks
of 128 rows, so it streams too, after any fold.
"""

import math
from collections.abc import Iterator

import torch

from mergeflow import fp8
from mergeflow.dtypes import parse_dtype_name
from mergeflow.formats.base import TensorIndex, TensorSource
from mergeflow.lora import LoraFold
from mergeflow.output.streaming import CHUNK_BYTES, row_ranges
from mergeflow.planning import OutputTensor

FOLD_DTYPE = torch.float32
QUANTIZE_TEMPORARIES = 4
"""Quantizing a band of float32 rows makes about this many temporaries of its size: bands of chunk_bytes /
QUANTIZE_TEMPORARIES keep an FP8 merge's memory that of a bf16 merge."""


class PlannedTensors:
    """Planned output tensors, read from a checkpoint's tensor source; `verify` checks what was read.

    A quantized weight's scales are computed as its blocks of rows are, and kept until they are written:
    the plan puts them right after the weight, in the same file."""

    def __init__(self, index: TensorIndex):
        self._index = index
        self._source: TensorSource = index.open()
        self._last_piece: tuple[tuple, torch.Tensor] | None = None
        self._scales: dict[str, torch.Tensor] = {}
        self.fp8_errors: dict[str, float] = {}
        """Each quantized weight's largest relative rounding error (in e4m3's normal range)."""
        self.fp8_outside: list[str] = []
        """Quantized weights with an element outside FP8's rounding bound (none, when quantization is right)."""

    def chunks(self, tensor: OutputTensor, chunk_bytes: int = CHUNK_BYTES) -> Iterator[torch.Tensor]:
        """The planned tensor's contents, as consecutive row blocks of at most about `chunk_bytes`."""
        if tensor.scale_of is not None:
            yield self._scales.pop(tensor.scale_of)
            return
        if tensor.quantized:
            yield from self._quantized_chunks(tensor, chunk_bytes)
            return
        dtype = parse_dtype_name(tensor.dtype)
        folder = self._folder(tensor)
        for start, stop in row_ranges(tensor.shape, FOLD_DTYPE.itemsize if folder else dtype.itemsize, chunk_bytes):
            yield self._rows_in(tensor, start, stop, dtype, folder)

    def rows(self, tensor: OutputTensor, start: int, stop: int) -> torch.Tensor:
        """Rows `[start, stop)` of the planned tensor (a 0-d tensor whole), before any quantization."""
        dtype = parse_dtype_name(tensor.dtype)
        folder = self._folder(tensor)
        return self._rows_in(tensor, start, stop, dtype, folder)

    def _folder(self, tensor: OutputTensor) -> "LoraFolder | None":
        """What folds the tensor's LoRA into its rows, if it has one."""
        return LoraFolder(tensor.fold, self._source, self._index) if tensor.fold is not None else None

    def _rows_in(
        self, tensor: OutputTensor, start: int, stop: int, dtype: torch.dtype, folder: "LoraFolder | None"
    ) -> torch.Tensor:
        if tensor.view is not None:
            return self._viewed_rows(tensor, start, stop, dtype)
        if folder is not None:
            return folder.rows(tensor.source, start, stop).to(dtype)
        return self._source.rows(tensor.source, start, stop, dtype)

    def _quantized_chunks(self, tensor: OutputTensor, chunk_bytes: int) -> Iterator[torch.Tensor]:
        """FP8 rows of a weight, whole 128-row blocks at a time (from float32), its scales kept for later and its
        rounding error against the rows it was quantized from recorded."""
        folder = self._folder(tensor)
        band_bytes = chunk_bytes // QUANTIZE_TEMPORARIES
        rows_per_chunk = max(fp8.BLOCK, band_bytes // (FOLD_DTYPE.itemsize * tensor.shape[1]) // fp8.BLOCK * fp8.BLOCK)
        scales, largest_error, within = [], 0.0, True
        for start in range(0, tensor.shape[0], rows_per_chunk):
            stop = min(start + rows_per_chunk, tensor.shape[0])
            rows = self._rows_in(tensor, start, stop, FOLD_DTYPE, folder)
            quantized = fp8.quantize(rows)
            largest_error = max(largest_error, quantized.largest_relative_error)
            within = within and not quantized.outside
            scales.append(quantized.scales)
            yield quantized.values
        self._scales[tensor.name] = torch.cat(scales)
        self.fp8_errors[tensor.name] = largest_error
        if not within:
            self.fp8_outside.append(tensor.name)

    def _viewed_rows(self, tensor: OutputTensor, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows of a tensor that is a strided view of its source: the source rows the view's elements lie
        in are read and cast, and the view copied out of them."""
        shape = (stop - start, *tensor.shape[1:]) if tensor.shape else ()
        if math.prod(shape) == 0:
            return torch.empty(shape, dtype=dtype)
        stride = tensor.view.stride
        first = tensor.view.offset + (start * stride[0] if shape else 0)
        last = first + sum((size - 1) * step for size, step in zip(shape, stride, strict=True))
        row = math.prod(self._index.tensors[tensor.source].shape[1:])
        low, high = first // row, last // row + 1
        piece = self._piece(tensor.source, low, high, dtype)
        return torch.as_strided(piece, shape, stride, piece.storage_offset() + first - low * row).contiguous()

    def _piece(self, name: str, low: int, high: int, dtype: torch.dtype) -> torch.Tensor:
        """Source rows `[low, high)` in `dtype`; the last piece is kept, as consecutive tensors (one expert's
        gate and up projections) are views of the same rows."""
        key = (name, low, high, dtype)
        if self._last_piece is None or self._last_piece[0] != key:
            self._last_piece = None
            self._last_piece = (key, self._source.rows(name, low, high, dtype))
        return self._last_piece[1]

    def verify(self) -> None:
        self._source.verify()

    def close(self) -> None:
        self._last_piece = None
        self._source.close()


class LoraFolder:
    """One weight's LoRA factors, held in float32, added to blocks of the weight's rows."""

    def __init__(self, fold: LoraFold, source: TensorSource, index: TensorIndex):
        self._fold = fold
        self._source = source
        self._index = index
        lora_a, lora_b = self._whole(fold.lora_a), self._whole(fold.lora_b)
        self._left, self._right = (lora_a.T, lora_b.T) if fold.transposed else (lora_b, lora_a)
        """Rows of the delta are rows of `left` times `right`: B·A, or (B·A)ᵀ = Aᵀ·Bᵀ."""
        self._magnitude = self._whole(fold.magnitude) if fold.magnitude else None

    def _whole(self, name: str) -> torch.Tensor:
        return self._source.rows(name, 0, self._index.tensors[name].shape[0], FOLD_DTYPE)

    def rows(self, weight: str, start: int, stop: int) -> torch.Tensor:
        """Rows `[start, stop)` of the folded weight, in float32 (the source's rows are not modified)."""
        rows = self._source.rows(weight, start, stop, FOLD_DTYPE) + self._fold.scaling * (
            self._left[start:stop] @ self._right
        )
        if self._magnitude is not None:
            rows *= (self._magnitude[start:stop] / torch.linalg.norm(rows, dim=1)).unsqueeze(1)
        return rows
