"""How megatron-core names a model's tensors: locating a stored key's layers and experts in its family's key table
(`families`, `tables`), and the HF tensors each key template holds, with their cuts (`cuts`)."""

import itertools
import re
from dataclasses import dataclass
from typing import NamedTuple

from mergeflow.errors import PlanError
from mergeflow.formats.dcp import StoredTensor
from mergeflow.formats.megatron.cuts import COPY, GATE, UP, Geometry, K, Q, V, joined
from mergeflow.formats.megatron.families import FAMILIES, Family, KeyTable

LAYERS = re.compile(r"^decoder\.layers\.(?:(\d+)\.)?")
"""A decoder-layer key: stacked (no index, layers on the first axis) or one layer's (`decoder.layers.3.`)."""
DEEPSTACK_MERGERS = re.compile(r"^decoder\.deepstack_merger_list\.(?:(\d+)\.)?")
"""A Qwen3-VL vision tower's DeepStack merger key: stacked (no index) or one merger's, as decoder layers are."""
MTP_LAYERS = re.compile(r"^mtp\.layers\.(\d+)\.")
"""A multi-token-prediction layer's key (`mtp.layers.0.`): it follows the decoder's layers."""
MTP_DECODER_LAYER = re.compile(r"^(?:transformer_layer|mtp_model_layer)\.")
"""Within an MTP layer, its decoder layer, keyed as the decoder's layers are (`transformer_layer.` up to
megatron-core 0.16, `mtp_model_layer.` in later releases, which Megatron-Bridge runs on)."""
EXPERTS = re.compile(r"\.experts\.experts\.(?:(\d+)\.)?")
"""Routed experts: on an axis of their own (no index) or one key per expert (`.experts.experts.7.`)."""
TRAINING_STATE = re.compile(r"^(?:chained_\d+\.)?optimizer\.")
"""Optimizer state (Adam moments, fp32 master weights) that verl's 2025 layout saved in the same archive."""
MEGATRON_FSDP_KEY = re.compile(r"^model\d*\.(?:module\.)?(?:embedding|decoder|output_layer|language_model|vision_model)\.")
"""A tensor of a Megatron-FSDP checkpoint (verl's `use_megatron_fsdp`): the wrapped model's DTensor state dict saved
by torch DCP under its place in verl's state dict (`model.`, `model0.` per virtual stage), where megatron-core's
dist_checkpointing keys tensors by their own names. Derived from verl 0.9.1's `MegatronCheckpointManager` and
megatron-core 0.16.1's `transformer/fsdp_dtensor_checkpoint.py`; no such archive was written here."""
ADAPTER = re.compile(r"^(?P<base>.+)\.adapter\.linear_(?P<side>in|out)\.weight$")
"""A LoRA adapter's tensor, as Megatron-Bridge's `LoRALinear` saves it beside the layer it adapts: `linear_in` is
PEFT's lora_A, `linear_out` its lora_B."""
LORA_ADAPTER_NAME = "default"
GLU_HALF = re.compile(r"^(.+)_([wv])$")

LANGUAGE_MODEL, VISION_MODEL = "language_model.", "vision_model."
"""What the keys of each tower of a vision-language model start with."""


VALUE_HEAD = ("score.weight", COPY)
"""A value model's `output_layer` (one output) is its `score` head."""


class Stack(NamedTuple):
    """A list of modules megatron-core saves stacked on a leading axis, or one key per module."""

    pattern: re.Pattern
    prefix: str
    axis: str
    """The field that names a module of the list in the table's templates."""
    count: str
    """The Geometry field that says how many modules the list holds."""


STACKS = (
    Stack(LAYERS, "decoder.layers.", "layer", "num_layers"),
    Stack(DEEPSTACK_MERGERS, "decoder.deepstack_merger_list.", "index", "num_deepstack_mergers"),
)


@dataclass(frozen=True)
class Component:
    """The stored tensors of one model: a language model's, or one tower of a vision-language model."""

    prefix: str
    """What its keys start with (`vision_model.`); empty for a language model's archive."""
    table: KeyTable
    geometry: Geometry
    hf_names: bool = False
    """Its keys are the HF names already (`Family.hf_module_tower`): each is copied under its own name."""


def family_of(config) -> Family:
    """The record of the config's model type.

    Raises:
        PlanError: a model type the Megatron backend does not read.
    """
    if config.model_type not in FAMILIES:
        raise PlanError(
            f'unknown architecture for the Megatron backend: model_type "{config.model_type}"; supported: '
            f"{', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[config.model_type]


def components_of(config) -> list[Component]:
    """The models an archive of `config`'s model type holds, each with its key prefix, table and geometry."""
    family = family_of(config)
    if family.vision is None:
        return [Component("", family.table, geometry_of(config, family))]
    vision = config.vision_config
    vision_geometry = Geometry(
        num_layers=vision.depth,
        num_heads=vision.num_heads,
        num_query_groups=vision.num_heads,
        head_dim=vision.hidden_size // vision.num_heads,
        vocab_size=0,
        num_experts=0,
        num_deepstack_mergers=len(getattr(vision, "deepstack_visual_indexes", None) or ()),
    )
    components = [
        Component(LANGUAGE_MODEL, family.table, geometry_of(config.get_text_config(), family)),
        Component(VISION_MODEL, family.vision, vision_geometry),
    ]
    if family.hf_module_tower is not None:
        components.append(Component(family.hf_module_tower, {}, vision_geometry, hf_names=True))
    return components


def geometry_of(config, family: Family) -> Geometry:
    """The geometry of a (text) config of the family."""
    return Geometry(
        output_gate=family.output_gate,
        linear_key_heads=getattr(config, "linear_num_key_heads", None) or 0,
        linear_key_dim=(getattr(config, "linear_num_key_heads", None) or 0) * (getattr(config, "linear_key_head_dim", None) or 0),
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_query_groups=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        vocab_size=config.vocab_size,
        num_experts=getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0,
    )


def targets(template: str, table: KeyTable) -> list[tuple[str, str]] | None:
    """The HF tensors of a key template. A `_w`/`_v` half of a fused gate|up is its gate or up tensor, or, where
    the HF tensor holds both (gpt-oss's interleaved experts), the first or second piece of it."""
    if template in table:
        return table[template]
    half = GLU_HALF.match(template)
    fused = table.get(half[1]) if half else None
    if fused is None:
        return None
    if [part for _, part in fused] == [GATE, UP]:
        gate, up = fused
        return [(gate[0] if half[2] == "w" else up[0], COPY)]
    return [(name, joined(part, 0 if half[2] == "w" else 1)) for name, part in fused if part not in (Q, K, V, GATE, UP)] or None


def adapter_targets(template: str, table: KeyTable) -> list[tuple[str, str]] | None:
    """The PEFT LoRA tensors of an adapter's key template, one per HF module its layer's weight holds: lora_A
    (`linear_in`, the same for every module of a fused layer: q, k and v; gate and up) and lora_B (`linear_out`,
    cut as the layer's weight is). None for a key that is not an adapter's, or whose layer is not a plain or
    fused linear one."""
    adapter = ADAPTER.match(template)
    layer = targets(f"{adapter['base']}.weight", table) if adapter else None
    if layer is None or any(part not in (COPY, Q, K, V, GATE, UP) for _, part in layer):
        return None
    side = "lora_A" if adapter["side"] == "in" else "lora_B"
    return [
        (f"{name.removesuffix('.weight')}.{side}.{LORA_ADAPTER_NAME}.weight", COPY if side == "lora_A" else part)
        for name, part in layer
    ]


def locate(key: str, entry: StoredTensor, geometry: Geometry) -> tuple[str, list[tuple[tuple[int, ...], dict[str, int]]]]:
    """The table template of a stored key, and each (layer, expert) it holds: the indices into its stacked
    axes and the fields that name the HF tensor.

    Raises:
        PlanError: a stacked axis whose length is not the config's number of layers or experts.
    """
    mtp = MTP_LAYERS.match(key)
    if mtp is not None:
        layer, rest = geometry.num_layers + int(mtp[1]), key[mtp.end() :]
        if decoder_layer := MTP_DECODER_LAYER.match(rest):
            return locate(f"decoder.layers.{layer}.{rest[decoder_layer.end() :]}", entry, geometry)
        return f"mtp.layers.{{layer}}.{rest}", [((), {"layer": layer})]
    stack = next(((stack, match) for stack in STACKS if (match := stack.pattern.match(key))), None)
    if stack is None:
        return key, [((), {})]
    (_, prefix, axis, count), match = stack
    rest = key[match.end() :]
    fields: dict[str, int] = {}
    stacked: list[tuple[str, int]] = []
    if match[1] is not None:
        fields[axis] = int(match[1])
    else:
        stacked.append((axis, getattr(geometry, count)))
    experts = EXPERTS.search(rest)
    if experts:
        rest = f"{rest[: experts.start()]}.experts.{{expert}}.{rest[experts.end() :]}"
        if experts[1] is not None:
            fields["expert"] = int(experts[1])
        else:
            stacked.append(("expert", geometry.num_experts))
    expected = tuple(size for _, size in stacked)
    if entry.shape[: len(stacked)] != expected:
        axes = " x ".join(f"{size} {axis}s" for axis, size in stacked)
        raise PlanError(f"{key} has shape {entry.shape}: expected {axes} first, as the config says")
    placements = [
        (leading, {**fields, **{axis: index for (axis, _), index in zip(stacked, leading, strict=True)}})
        for leading in itertools.product(*(range(size) for size in expected))
    ]
    return f"{prefix}{{{axis}}}.{rest}", placements
