"""What a checkpoint format gives the rest of the pipeline: where its files are, an index of its tensors
(names, shapes, dtypes) from metadata alone, and a source of their rows. Planning, writing, LoRA and
validation use these protocols only; a backend is a folder of `formats/` that implements them."""

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from mergeflow.spec.model_spec import ModelSpec


class StoredTensor(Protocol):
    """One tensor of the checkpoint, under its Hugging Face (or PEFT) name."""

    name: str
    dtype: str
    """torch's name of its dtype (`bfloat16`)."""
    shape: tuple[int, ...]


class TensorSource(Protocol):
    """Reads rows of the checkpoint's tensors, checking what it read against the checkpoint's checksums."""

    def rows(self, name: str, start: int, stop: int, dtype: "torch.dtype") -> "torch.Tensor":
        """Rows `[start, stop)` of tensor `name` (a 0-d tensor whole), cast to `dtype`."""
        ...

    def verify(self) -> None:
        """Raise CheckpointError if anything read so far does not match the checkpoint's checksums."""
        ...

    def close(self) -> None: ...


class TensorIndex(Protocol):
    """Every tensor of one checkpoint, from metadata alone."""

    checkpoint_dir: str
    world_size: int
    tensors: Mapping[str, StoredTensor]
    aliases: Mapping[str, str]
    """Names stored once for two (tied weights), mapped to the name that holds the data."""

    def facts(self) -> dict[str, object]:
        """How it was saved (mesh, tensor parallelism), for reports and `mergeflow inspect`."""
        ...

    def open(self) -> TensorSource: ...


class Layout(Protocol):
    """Where one checkpoint's files are, found from their names alone (imports no torch)."""

    checkpoint_dir: str

    @property
    def world_size(self) -> int: ...

    @property
    def data_files(self) -> tuple[str, ...]:
        """The files holding tensor data (what is read ahead)."""
        ...

    @property
    def config_dir(self) -> str:
        """The Hugging Face config directory saved with the checkpoint."""
        ...

    @property
    def model_dir(self) -> str | None:
        """A folder that already holds the Hugging Face model (nothing to merge), if the checkpoint has one."""
        ...

    def index(self, spec: "ModelSpec") -> TensorIndex: ...
