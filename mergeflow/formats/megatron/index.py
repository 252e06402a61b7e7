"""The index of a verl Megatron checkpoint (a `torch_dist` PyTorch DCP archive of megatron-core's global
tensors) under Hugging Face names, without megatron-core or a GPU, and the reader of its tensors.

Layouts verl has written: `actor/model/dist_ckpt/` + `actor/model/huggingface/` (current) and
`actor/dist_ckpt/` + `actor/huggingface/` (2025). Layers are stacked along a leading axis or stored one
key per layer; MoE experts likewise; a vision-language model's two towers sit under key prefixes of their
own (`mergeflow.formats.megatron.names` maps them all); a tensor megatron-core saves in pieces (several keys) is
joined before it is cut. LoRA adapters saved beside the layers they adapt are named as the PEFT model that holds
them names them. A key the tables do not know is an error that names it, never a dropped tensor.
"""

import dataclasses
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from mergeflow.dtypes import dtype_name
from mergeflow.errors import CheckpointError, PlanError, quoted
from mergeflow.formats.dcp import StoredTensor, read_metadata, read_slice
from mergeflow.formats.megatron.cuts import (
    COPY,
    RANK_HALVES,
    Geometry,
    part_shape,
    per_rank,
    split_joined,
    split_part,
)
from mergeflow.formats.megatron.layout import MegatronLayout
from mergeflow.formats.megatron.names import (
    MEGATRON_FSDP_KEY,
    TRAINING_STATE,
    VALUE_HEAD,
    adapter_targets,
    components_of,
    family_of,
    locate,
    targets,
)
from mergeflow.formats.megatron.tables import MTP_SHARED
from mergeflow.spec.config_values import ConfigValues
from mergeflow.spec.model_spec import DECODER_LAYER, MTP_PREFIX, ModelSpec
from mergeflow.spec.peft_names import PEFT_PREFIX, lora_tensor_names

ANY_DECODER_LAYER = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.")
"""A decoder layer's tensor, in a language model or in a vision-language model's language model."""

Slice = tuple[str, tuple[int, ...]]
"""A stored key, and the indices into its stacked axes (layer, expert) that select one layer's (or expert's) tensor."""


@dataclass(frozen=True)
class MegatronTensor:
    """One Hugging Face tensor, as a part of one layer of a stored megatron-core tensor (or, for a model that
    saves all of a layer's experts in one tensor, the parts of each expert's, stacked)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    slices: tuple[Slice, ...]
    """What the tensor is cut from: one stored slice, or several joined along their rows (a fused tensor
    megatron-core saves in parts: the gated delta net's q, k and v; an expert's gate and up halves)."""
    part: str
    geometry: Geometry
    """Of the model the stored tensor belongs to (a vision-language model's towers differ)."""
    experts: tuple[tuple[Slice, ...], ...] = ()
    """For a tensor of all experts: each expert's slices, in expert order; row i is expert i's part."""

    @property
    def key(self) -> str:
        return self.slices[0][0]


@dataclass(frozen=True)
class MegatronIndex:
    """The checkpoint's tensors under Hugging Face names, from metadata alone: the Megatron backend's
    `TensorIndex`."""

    checkpoint_dir: str
    dist_ckpt_dir: str
    world_size: int
    tensor_parallel: int | None
    tensors: dict[str, MegatronTensor]
    stored: dict[str, StoredTensor]
    geometry: Geometry
    aliases: dict[str, str]
    saved_layout: str
    parallelism: dict[str, int]
    """The parallel sizes verl recorded with the archive (`MegatronLayout.parallelism`)."""

    def facts(self) -> dict[str, object]:
        return {"layout": self.saved_layout, "tensor_parallel": self.tensor_parallel, **self.parallelism}

    def open(self) -> "MegatronSource":
        return MegatronSource(self)


def index_megatron(layout: MegatronLayout, spec: ModelSpec) -> MegatronIndex:
    """Every Hugging Face tensor the checkpoint holds, with its shape, from `.metadata` and the config.

    Raises:
        PlanError: an architecture the tables do not cover, or keys they cannot map.
        CheckpointError: an unreadable archive, or none (the HF weights are there already: nothing to index).
    """
    if layout.dist_ckpt_dir is None:
        raise CheckpointError(
            f"{layout.hf_dir} already holds the Hugging Face model and there is no dist_ckpt/ to read: "
            f"check it with `mergeflow validate {layout.hf_dir}`"
        )
    config = ConfigValues(spec.config_values)
    try:
        family = family_of(config)
    except PlanError as error:
        raise PlanError(f"{error} ({spec.architecture} in {spec.config_dir}/config.json)") from None
    components = components_of(config)
    geometry = components[0].geometry
    stored = {
        key: entry for key, entry in read_metadata(Path(layout.dist_ckpt_dir)).items() if not TRAINING_STATE.match(key)
    }
    _refuse_megatron_fsdp(stored, layout)
    tensors: dict[str, MegatronTensor] = {}
    expert_parts: dict[str, dict[int, MegatronTensor]] = {}
    pieces: dict[tuple[str, int | None], dict[int, tuple[MegatronTensor, tuple[int, ...]]]] = {}
    unmapped = []

    def place(tensor: MegatronTensor, expert: int | None) -> None:
        """Keep the tensor, or, for a name that holds all of a layer's experts, this expert's part of it."""
        if expert is None:
            tensors[tensor.name] = tensor
        else:
            expert_parts.setdefault(tensor.name, {})[expert] = tensor

    for key, entry in stored.items():
        component = next((component for component in components if key.startswith(component.prefix)), None)
        if component is None:
            unmapped.append(key)
            continue
        if component.hf_names:
            template, placements, hf_names = key, [((), {})], [(key, COPY)]
        else:
            template, placements = locate(key.removeprefix(component.prefix), entry, component.geometry)
            hf_names = targets(template, component.table) or adapter_targets(template, component.table)
        if template == "output_layer.weight" and spec.is_value_model:
            hf_names = [VALUE_HEAD]
        if hf_names is None:
            unmapped.append(key)
            continue
        for leading, fields in placements:
            for name_template, joined_part in hf_names:
                name = name_template.format(**fields)
                expert = fields["expert"] if "expert" in fields and "{expert}" not in name_template else None
                part, position = split_joined(joined_part)
                if part == RANK_HALVES:
                    part = per_rank(part, _row_ranks(entry, len(leading)))
                stored_shape = entry.shape[len(leading) :]
                tensor = MegatronTensor(name, dtype_name(entry.dtype), stored_shape, ((key, leading),), part, component.geometry)
                if position is not None:
                    pieces.setdefault((name, expert), {})[position] = (tensor, stored_shape)
                    continue
                place(dataclasses.replace(tensor, shape=part_shape(part, stored_shape, component.geometry, key)), expert)
    for (_, expert), parts in pieces.items():
        place(_joined([parts[position] for position in sorted(parts)]), expert)
    tensors |= {name: _all_experts(parts, geometry) for name, parts in expert_parts.items()}
    if family.mtp_under_own_names:
        tensors = _mtp_layers_under_their_own_names(tensors, geometry)
    else:
        tensors |= _mtp_shared_tensors(tensors, geometry)
    if lora_tensor_names(tensors):
        tensors = _as_peft_model(tensors)
    if unmapped:
        raise PlanError(
            f"unmapped key(s) for {config.model_type} in {layout.dist_ckpt_dir}: {quoted(unmapped)}. "
            "Add them to the family's tables (mergeflow/formats/megatron/tables.py, families.py)."
        )
    return MegatronIndex(
        checkpoint_dir=layout.checkpoint_dir,
        dist_ckpt_dir=layout.dist_ckpt_dir,
        world_size=layout.world_size,
        tensor_parallel=_tensor_parallel(stored),
        tensors=tensors,
        stored=stored,
        geometry=geometry,
        aliases={},
        saved_layout=layout.saved_layout,
        parallelism=layout.parallelism(),
    )


def _refuse_megatron_fsdp(stored: dict[str, StoredTensor], layout: MegatronLayout) -> None:
    """Refuse an archive that Megatron-FSDP wrote (`MEGATRON_FSDP_KEY`): this backend does not read it.

    Raises:
        CheckpointError: naming the archive and one of its keys.
    """
    keys = [key for key in stored if MEGATRON_FSDP_KEY.match(key)]
    if keys:
        raise CheckpointError(
            f"{layout.dist_ckpt_dir} is a Megatron-FSDP checkpoint (verl's use_megatron_fsdp: DTensors saved by torch "
            f'DCP under the wrapped model\'s names, such as "{keys[0]}"), which mergeflow does not read',
            hint="save the Hugging Face model with it (checkpoint save_contents including hf_model) and pass "
            "--backend hf, or train with Megatron's distributed optimizer instead of Megatron-FSDP",
        )


def _joined(parts: list[tuple[MegatronTensor, tuple[int, ...]]]) -> MegatronTensor:
    """One tensor of stored slices joined along their rows, then cut as its part says."""
    first, first_shape = parts[0]
    shape = (sum(stored_shape[0] for _, stored_shape in parts), *first_shape[1:])
    return dataclasses.replace(
        first,
        shape=part_shape(first.part, shape, first.geometry, first.key),
        slices=tuple(one for tensor, _ in parts for one in tensor.slices),
    )


def _all_experts(parts: dict[int, MegatronTensor], geometry: Geometry) -> MegatronTensor:
    """One tensor of every expert's part, stacked in expert order.

    Raises:
        PlanError: the archive holds other experts than the config's.
    """
    first = parts[min(parts)]
    if sorted(parts) != list(range(geometry.num_experts)):
        raise PlanError(f"{first.name}: the archive holds experts {sorted(parts)}, the config {geometry.num_experts}")
    return dataclasses.replace(
        first,
        shape=(geometry.num_experts, *first.shape),
        experts=tuple(parts[expert].slices for expert in sorted(parts)),
    )


def _mtp_layers_under_their_own_names(tensors: dict[str, MegatronTensor], geometry: Geometry) -> dict[str, MegatronTensor]:
    """The tensors with each MTP layer's decoder layer (mapped as layer `num_layers + k`) renamed `mtp.layers.{k}.*`,
    as Qwen3-Next's and Qwen3.5's checkpoints name it."""

    def renamed(name: str) -> str:
        layer = ANY_DECODER_LAYER.match(name)
        if layer is None or int(layer[1]) < geometry.num_layers:
            return name
        return f"{MTP_PREFIX}layers.{int(layer[1]) - geometry.num_layers}.{name[layer.end() :]}"

    return _renamed(tensors, renamed)


def _mtp_shared_tensors(tensors: dict[str, MegatronTensor], geometry: Geometry) -> dict[str, MegatronTensor]:
    """Each MTP layer's copies of the embedding and the head (the head is the embedding when tied), read
    from the tensors megatron-core shares with the main model."""
    layers = {
        int(match[1])
        for name in tensors
        if (match := DECODER_LAYER.match(name)) and int(match[1]) >= geometry.num_layers
    }
    copies = {}
    for layer in sorted(layers):
        for name_in_layer, shared in MTP_SHARED.items():
            source = tensors.get(shared) or tensors[MTP_SHARED["embed_tokens.weight"]]
            name = f"model.layers.{layer}.{name_in_layer}"
            copies[name] = dataclasses.replace(source, name=name)
    return copies


def _as_peft_model(tensors: dict[str, MegatronTensor]) -> dict[str, MegatronTensor]:
    """The tensors of a checkpoint with LoRA adapters under the names of the PEFT model that holds them (as an
    FSDP checkpoint of a LoRA run names them): `base_model.model.` first, and `.base_layer.` inside each adapted
    module, so that the LoRA planning reads both backends alike."""
    adapted = {name.partition(".lora_")[0] for name in lora_tensor_names(tensors)}

    def peft_name(name: str) -> str:
        module, _, parameter = name.rpartition(".")
        return PEFT_PREFIX + (f"{module}.base_layer.{parameter}" if module in adapted else name)

    return _renamed(tensors, peft_name)


def _renamed(tensors: dict[str, MegatronTensor], name_of: Callable[[str], str]) -> dict[str, MegatronTensor]:
    renamed = {}
    for name, tensor in tensors.items():
        new_name = name_of(name)
        renamed[new_name] = dataclasses.replace(tensor, name=new_name)
    return renamed


def _row_ranks(entry: StoredTensor, stacked_axes: int) -> int:
    """How many TP ranks a tensor's rows were split over: its chunks' distinct row offsets."""
    return len({chunk.offsets[stacked_axes] for chunk in entry.chunks})


def _tensor_parallel(stored: dict[str, StoredTensor]) -> int | None:
    """TP size, from how one layer's attention output projection is split (by input columns)."""
    key = next((key for key in sorted(stored) if key.endswith("self_attention.linear_proj.weight")), None)
    if key is None:
        return None
    return sum(1 for chunk in stored[key].chunks if not any(chunk.offsets[:-1]))


class MegatronSource:
    """Reads the archive's tensors (the Megatron backend's `TensorSource`): one stored layer (or expert) at a
    time, the last few kept so that the parts of a fused tensor (QKV, gate|up) cost one read, and the last
    parts cast, so that their rows are cut from one conversion."""

    CACHED_SLICES = 4
    CACHED_PARTS = 2

    def __init__(self, index: MegatronIndex):
        self._index = index
        self._slices: OrderedDict[tuple[str, tuple[int, ...]], torch.Tensor] = OrderedDict()
        self._parts: OrderedDict[tuple[str, torch.dtype], torch.Tensor] = OrderedDict()

    def rows(self, name: str, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        tensor = self._index.tensors[name]
        if tensor.experts:
            return torch.stack([self._part(tensor, tensor.experts[expert], dtype) for expert in range(start, stop)])
        value = _cached(self._parts, (name, dtype), self.CACHED_PARTS, lambda: self._part(tensor, tensor.slices, dtype))
        return value if not value.dim() else value[start:stop]

    def _part(self, tensor: MegatronTensor, slices: tuple[Slice, ...], dtype: torch.dtype) -> torch.Tensor:
        stored = [
            _cached(
                self._slices,
                (key, leading),
                self.CACHED_SLICES,
                lambda key=key, leading=leading: read_slice(
                    Path(self._index.dist_ckpt_dir), self._index.stored[key], leading
                ),
            )
            for key, leading in slices
        ]
        joined = stored[0] if len(stored) == 1 else torch.cat(stored)
        return split_part(joined, tensor.part, tensor.geometry).to(dtype)

    def verify(self) -> None:
        """Nothing left to check: each chunk is checked against its CRC-32 as it is loaded (`dcp.load_chunk`)."""

    def close(self) -> None:
        self._slices.clear()
        self._parts.clear()


def _cached(cache: OrderedDict, key, size: int, compute):
    """`cache[key]`, computed on a miss; the least recently used entries beyond `size` are dropped."""
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    value = cache[key] = compute()
    while len(cache) > size:
        cache.popitem(last=False)
    return value
