"""A checkpoint's merged tensors as a tensor source, read straight from the checkpoint (nothing written).

This is what `mergeflow test` compares against a reference, as verl's `test` does, but a block of
rows at a time instead of the whole merged model in memory.
"""

import torch

from mergeflow.dtypes import parse_dtype_name
from mergeflow.formats.base import TensorIndex
from mergeflow.output.materialize import PlannedTensors
from mergeflow.output.model_folder import TensorInfo
from mergeflow.planning import MergePlan


class MergedCheckpoint:
    """The tensors a merge plan would write, assembled on demand from the rank files."""

    def __init__(self, plan: MergePlan, index: TensorIndex):
        self._plan = plan
        self._index = index
        self._reader = PlannedTensors(index)

    def names(self) -> list[str]:
        return list(self._plan.tensors)

    def info(self, name: str) -> TensorInfo:
        tensor = self._plan.tensors[name]
        return TensorInfo(parse_dtype_name(tensor.dtype), tensor.shape)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._reader.rows(self._plan.tensors[name], start, stop)

    def verify(self) -> None:
        """Check what was read against the checkpoint's CRC-32s."""
        self._reader.verify()

    def close(self) -> None:
        self._reader.close()

    def __enter__(self) -> "MergedCheckpoint":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
