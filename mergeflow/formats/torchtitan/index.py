"""The index of a torchtitan archive: its model tensors under Hugging Face names (`names`), from `.metadata` alone,
and a reader of their rows. Optimizer, LR scheduler and train state are left out."""

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mergeflow.dtypes import dtype_name
from mergeflow.errors import CheckpointError, PlanError, quoted
from mergeflow.formats.dcp import StoredTensor, read_metadata, read_slice
from mergeflow.formats.torchtitan.names import EXPERT_BIAS, TRAINING_STATE, family_of, hf_name, template_of
from mergeflow.spec.config_values import ConfigValues
from mergeflow.spec.model_spec import ModelSpec

if TYPE_CHECKING:
    from mergeflow.formats.torchtitan.layout import TorchTitanCheckpoint


@dataclass(frozen=True)
class TitanTensor:
    """One model tensor of the archive, under its Hugging Face name, and the key it is stored under."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    key: str
    interleaved_heads: int | None = None
    """For rows held with each head's rotary halves interleaved: the number of heads (`Family.interleaved_rotary`)."""


@dataclass(frozen=True)
class TorchTitanIndex:
    """The TorchTitan backend's `TensorIndex`."""

    checkpoint_dir: str
    archive_dir: str
    world_size: int
    tensors: dict[str, TitanTensor]
    stored: dict[str, StoredTensor]
    left_out: tuple[str, ...]
    """Model tensors the Hugging Face model has no place for (zero load-balancing biases)."""
    aliases: dict[str, str]

    def facts(self) -> dict[str, object]:
        return {"archive": Path(self.archive_dir).name, "left_out": list(self.left_out)}

    def open(self) -> "TorchTitanSource":
        return TorchTitanSource(self)


def index_torchtitan(checkpoint: "TorchTitanCheckpoint", spec: ModelSpec) -> TorchTitanIndex:
    """Every model tensor of the archive under its Hugging Face name.

    Raises:
        PlanError: a model family without a table, or keys its table does not map.
        CheckpointError: an unreadable archive, or a load-balancing bias that is not zero.
    """
    config = ConfigValues(spec.config_values)
    family = family_of(config.model_type)
    archive = Path(checkpoint.archive_dir)
    stored = {key: entry for key, entry in read_metadata(archive).items() if not TRAINING_STATE.match(key)}
    biases = [key for key in stored if EXPERT_BIAS.match(key)]
    for key in biases:
        if read_slice(archive, stored[key]).any():
            raise CheckpointError(
                f'{archive}: "{key}" is not zero: torchtitan\'s load-balancing bias changes which experts each token '
                f"goes to, and {spec.architecture} has no place for it"
            )
    tensors, unmapped = {}, []
    for key, entry in stored.items():
        name = hf_name(key, family.table)
        if name is not None:
            heads = family.interleaved_rotary.get(template_of(key)[0])
            tensors[name] = TitanTensor(
                name, dtype_name(entry.dtype), entry.shape, key, getattr(config, heads) if heads else None
            )
        elif key not in biases:
            unmapped.append(key)
    if unmapped:
        raise PlanError(
            f"unmapped key(s) in {archive}: {quoted(unmapped)}. Add them to the family's table "
            "(mergeflow/formats/torchtitan/names.py), from torchtitan's state-dict adapter."
        )
    return TorchTitanIndex(
        checkpoint_dir=checkpoint.checkpoint_dir,
        archive_dir=str(archive),
        world_size=checkpoint.world_size,
        tensors=tensors,
        stored=stored,
        left_out=tuple(biases),
        aliases={},
    )


class TorchTitanSource:
    """Reads the archive's tensors (the TorchTitan backend's `TensorSource`): each stored tensor whole, once, kept
    cast while its rows are asked for."""

    def __init__(self, index: TorchTitanIndex):
        self._index = index
        self._current: tuple[str, torch.dtype, torch.Tensor] | None = None

    def rows(self, name: str, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        if self._current is None or self._current[:2] != (name, dtype):
            tensor = self._index.tensors[name]
            value = read_slice(Path(self._index.archive_dir), self._index.stored[tensor.key])
            if tensor.interleaved_heads:
                value = half_split_rotary(value, tensor.interleaved_heads)
            self._current = (name, dtype, value.to(dtype))
        value = self._current[2]
        return value if not value.dim() else value[start:stop]

    def verify(self) -> None:
        """Nothing left to check: each chunk is checked against its CRC-32 as it is loaded (`dcp.load_chunk`)."""

    def close(self) -> None:
        self._current = None


def half_split_rotary(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """A q or k projection's rows with each head's rotary pairs, interleaved (`x0 y0 x1 y1 …`, torchtitan's complex
    RoPE), reordered into Hugging Face's halves (`x0 x1 … y0 y1 …`)."""
    total, columns = rows.shape
    return rows.view(heads, total // heads // 2, 2, columns).transpose(1, 2).reshape(total, columns)
