"""verl Megatron checkpoints: a `torch_dist` (PyTorch DCP) archive of megatron-core's global tensors,
mapped onto Hugging Face names without megatron-core or a GPU.

Layouts verl has written: `actor/model/dist_ckpt/` + `actor/model/huggingface/` (current) and
`actor/dist_ckpt/` + `actor/huggingface/` (2025). The archive holds every tensor with its global
shape. Layers are stacked along a leading axis (`decoder.layers.self_attention.linear_qkv.weight` is
`(num_layers, rows, hidden)`) or, in models whose layers differ (dense and MoE), stored one key per
layer (`decoder.layers.3.…`); MoE experts likewise sit on an axis of their own
(`….mlp.experts.experts.linear_fc1.weight`) or one key per expert (`….experts.experts.7.…`, with the
gate and up halves of fc1 stored apart as `weight_w`/`weight_v`). `HF_FROM_MEGATRON` and the tables
of MoE and MLA models map each key to its Hugging Face tensors, as `save_pretrained` names them (one tensor per
expert), and the fused ones (QKV per query group, gate|up) are split by small named functions. A key
the tables do not know is an error that names it, never a dropped tensor.
"""

import itertools
import re
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from mergeflow.dtypes import dtype_name, parse_dtype_name
from mergeflow.errors import CheckpointError, PlanError, quoted
from mergeflow.formats.megatron.dcp import StoredTensor, read_metadata, read_slice
from mergeflow.formats.megatron.layout import MegatronLayout
from mergeflow.spec.model_spec import ModelSpec, load_config

LAYERS = re.compile(r"^decoder\.layers\.(?:(\d+)\.)?")
"""A decoder-layer key: stacked (no index, layers on the first axis) or one layer's (`decoder.layers.3.`)."""
EXPERTS = re.compile(r"\.experts\.experts\.(?:(\d+)\.)?")
"""Routed experts: on an axis of their own (no index) or one key per expert (`.experts.experts.7.`)."""
TRAINING_STATE = re.compile(r"^(?:chained_\d+\.)?optimizer\.")
"""Optimizer state (Adam moments, fp32 master weights) that verl's 2025 layout saved in the same archive."""
GLU_HALF = re.compile(r"^(.+)_([wv])$")
"""fc1 stored as its gate (`_w`) and up (`_v`) halves, as megatron-core writes singleton shards."""

COPY, VOCAB, Q, K, V, GATE, UP = "copy", "vocab", "q", "k", "v", "gate", "up"
HF_FROM_MEGATRON: dict[str, list[tuple[str, str]]] = {
    "embedding.word_embeddings.weight": [("model.embed_tokens.weight", VOCAB)],
    "decoder.final_layernorm.weight": [("model.norm.weight", COPY)],
    "output_layer.weight": [("lm_head.weight", VOCAB)],
    "decoder.layers.{layer}.self_attention.linear_qkv.layer_norm_weight": [
        ("model.layers.{layer}.input_layernorm.weight", COPY)
    ],
    "decoder.layers.{layer}.input_layernorm.weight": [("model.layers.{layer}.input_layernorm.weight", COPY)],
    "decoder.layers.{layer}.self_attention.linear_qkv.weight": [
        ("model.layers.{layer}.self_attn.q_proj.weight", Q),
        ("model.layers.{layer}.self_attn.k_proj.weight", K),
        ("model.layers.{layer}.self_attn.v_proj.weight", V),
    ],
    "decoder.layers.{layer}.self_attention.linear_qkv.bias": [
        ("model.layers.{layer}.self_attn.q_proj.bias", Q),
        ("model.layers.{layer}.self_attn.k_proj.bias", K),
        ("model.layers.{layer}.self_attn.v_proj.bias", V),
    ],
    "decoder.layers.{layer}.self_attention.q_layernorm.weight": [("model.layers.{layer}.self_attn.q_norm.weight", COPY)],
    "decoder.layers.{layer}.self_attention.k_layernorm.weight": [("model.layers.{layer}.self_attn.k_norm.weight", COPY)],
    "decoder.layers.{layer}.self_attention.linear_proj.weight": [("model.layers.{layer}.self_attn.o_proj.weight", COPY)],
    "decoder.layers.{layer}.mlp.linear_fc1.layer_norm_weight": [
        ("model.layers.{layer}.post_attention_layernorm.weight", COPY)
    ],
    "decoder.layers.{layer}.pre_mlp_layernorm.weight": [("model.layers.{layer}.post_attention_layernorm.weight", COPY)],
    "decoder.layers.{layer}.mlp.linear_fc1.weight": [
        ("model.layers.{layer}.mlp.gate_proj.weight", GATE),
        ("model.layers.{layer}.mlp.up_proj.weight", UP),
    ],
    "decoder.layers.{layer}.mlp.linear_fc2.weight": [("model.layers.{layer}.mlp.down_proj.weight", COPY)],
}
"""Dense decoders (Llama, Mistral, Qwen2, Qwen3), and the attention and norms of every model."""

QWEN_MOE: dict[str, list[tuple[str, str]]] = {
    "decoder.layers.{layer}.mlp.router.weight": [("model.layers.{layer}.mlp.gate.weight", COPY)],
    "decoder.layers.{layer}.mlp.experts.{expert}.linear_fc1.weight": [
        ("model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight", GATE),
        ("model.layers.{layer}.mlp.experts.{expert}.up_proj.weight", UP),
    ],
    "decoder.layers.{layer}.mlp.experts.{expert}.linear_fc2.weight": [
        ("model.layers.{layer}.mlp.experts.{expert}.down_proj.weight", COPY)
    ],
    "decoder.layers.{layer}.mlp.shared_experts.linear_fc1.weight": [
        ("model.layers.{layer}.mlp.shared_expert.gate_proj.weight", GATE),
        ("model.layers.{layer}.mlp.shared_expert.up_proj.weight", UP),
    ],
    "decoder.layers.{layer}.mlp.shared_experts.linear_fc2.weight": [
        ("model.layers.{layer}.mlp.shared_expert.down_proj.weight", COPY)
    ],
    "decoder.layers.{layer}.mlp.shared_experts.gate_weight": [("model.layers.{layer}.mlp.shared_expert_gate.weight", COPY)],
}
"""Qwen2-MoE (shared expert and its sigmoid gate) and Qwen3-MoE (routed experts only)."""

MIXTRAL_MOE: dict[str, list[tuple[str, str]]] = {
    "decoder.layers.{layer}.mlp.router.weight": [("model.layers.{layer}.block_sparse_moe.gate.weight", COPY)],
    "decoder.layers.{layer}.mlp.experts.{expert}.linear_fc1.weight": [
        ("model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight", GATE),
        ("model.layers.{layer}.block_sparse_moe.experts.{expert}.w3.weight", UP),
    ],
    "decoder.layers.{layer}.mlp.experts.{expert}.linear_fc2.weight": [
        ("model.layers.{layer}.block_sparse_moe.experts.{expert}.w2.weight", COPY)
    ],
}

MLA: dict[str, list[tuple[str, str]]] = {
    "decoder.layers.{layer}.self_attention.linear_q_proj.weight": [("model.layers.{layer}.self_attn.q_proj.weight", COPY)],
    "decoder.layers.{layer}.self_attention.linear_q_down_proj.weight": [
        ("model.layers.{layer}.self_attn.q_a_proj.weight", COPY)
    ],
    "decoder.layers.{layer}.self_attention.linear_q_up_proj.weight": [("model.layers.{layer}.self_attn.q_b_proj.weight", COPY)],
    "decoder.layers.{layer}.self_attention.linear_q_up_proj.layer_norm_weight": [
        ("model.layers.{layer}.self_attn.q_a_layernorm.weight", COPY)
    ],
    "decoder.layers.{layer}.self_attention.q_layernorm.weight": [
        ("model.layers.{layer}.self_attn.q_a_layernorm.weight", COPY)
    ],
    "decoder.layers.{layer}.self_attention.linear_kv_down_proj.weight": [
        ("model.layers.{layer}.self_attn.kv_a_proj_with_mqa.weight", COPY)
    ],
    "decoder.layers.{layer}.self_attention.linear_kv_up_proj.weight": [
        ("model.layers.{layer}.self_attn.kv_b_proj.weight", COPY)
    ],
    "decoder.layers.{layer}.self_attention.linear_kv_up_proj.layer_norm_weight": [
        ("model.layers.{layer}.self_attn.kv_a_layernorm.weight", COPY)
    ],
    "decoder.layers.{layer}.self_attention.kv_layernorm.weight": [
        ("model.layers.{layer}.self_attn.kv_a_layernorm.weight", COPY)
    ],
}
"""Multi-latent attention (DeepSeek-V3): low-rank q (or one q_proj without q_lora_rank) and kv projections
with their norms, stored by megatron-core in the HF layout (per head: no-RoPE part, then RoPE part)."""

DEEPSEEK_MOE: dict[str, list[tuple[str, str]]] = {
    "decoder.layers.{layer}.mlp.router.weight": [("model.layers.{layer}.mlp.gate.weight", COPY)],
    "decoder.layers.{layer}.mlp.router.expert_bias": [("model.layers.{layer}.mlp.gate.e_score_correction_bias", COPY)],
    "decoder.layers.{layer}.mlp.experts.{expert}.linear_fc1.weight": QWEN_MOE[
        "decoder.layers.{layer}.mlp.experts.{expert}.linear_fc1.weight"
    ],
    "decoder.layers.{layer}.mlp.experts.{expert}.linear_fc2.weight": QWEN_MOE[
        "decoder.layers.{layer}.mlp.experts.{expert}.linear_fc2.weight"
    ],
    "decoder.layers.{layer}.mlp.shared_experts.linear_fc1.weight": [
        ("model.layers.{layer}.mlp.shared_experts.gate_proj.weight", GATE),
        ("model.layers.{layer}.mlp.shared_experts.up_proj.weight", UP),
    ],
    "decoder.layers.{layer}.mlp.shared_experts.linear_fc2.weight": [
        ("model.layers.{layer}.mlp.shared_experts.down_proj.weight", COPY)
    ],
}
"""DeepSeek-V3's router with its expert bias (aux-loss-free balancing) and its ungated shared experts."""

TABLES_BY_MODEL_TYPE = {
    "qwen2_moe": QWEN_MOE,
    "qwen3_moe": QWEN_MOE,
    "mixtral": MIXTRAL_MOE,
    "deepseek_v3": {**MLA, **DEEPSEEK_MOE},
}
"""What a model type adds to (or overrides in) HF_FROM_MEGATRON."""
DENSE_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
SUPPORTED_MODEL_TYPES = DENSE_MODEL_TYPES | TABLES_BY_MODEL_TYPE.keys()
VALUE_HEAD = ("score.weight", COPY)
"""A value model's `output_layer` (one output) is its `score` head."""


@dataclass(frozen=True)
class Geometry:
    """What the fused tensors need from the HF config."""

    num_layers: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    num_experts: int


@dataclass(frozen=True)
class MegatronTensor:
    """One Hugging Face tensor, as a part of one layer of a stored megatron-core tensor."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    key: str
    leading: tuple[int, ...]
    """Indices into the stored tensor's stacked axes (layer, expert) that select this tensor's source."""
    part: str


@dataclass(frozen=True)
class MegatronIndex:
    """The checkpoint's tensors under Hugging Face names, from metadata alone."""

    checkpoint_dir: str
    dist_ckpt_dir: str
    world_size: int
    tensor_parallel: int | None
    tensors: dict[str, MegatronTensor]
    stored: dict[str, StoredTensor]
    geometry: Geometry
    aliases: dict[str, str]
    mesh_shape: tuple[int, ...] = ()
    mesh_dim_names: tuple[str, ...] | None = None
    fsdp_version: None = None


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
    config = load_config(Path(spec.config_dir), trust_remote_code=spec.trust_remote_code)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise PlanError(
            f'unknown architecture for the Megatron backend: model_type "{config.model_type}" '
            f"({spec.architecture}) in {spec.config_dir}/config.json; supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
        )
    geometry = _geometry(config)
    table = mapping_table(config.model_type)
    stored = {
        key: entry for key, entry in read_metadata(Path(layout.dist_ckpt_dir)).items() if not TRAINING_STATE.match(key)
    }
    tensors: dict[str, MegatronTensor] = {}
    unmapped = []
    for key, entry in stored.items():
        template, placements = _locate(key, entry, geometry)
        targets = _targets(template, table)
        if template == "output_layer.weight" and spec.is_value_model:
            targets = [VALUE_HEAD]
        if targets is None:
            unmapped.append(key)
            continue
        for leading, fields in placements:
            for name_template, part in targets:
                name = name_template.format(**fields)
                shape = _part_shape(part, entry.shape[len(leading) :], geometry, key)
                tensors[name] = MegatronTensor(name, dtype_name(entry.dtype), shape, key, leading, part)
    if unmapped:
        raise PlanError(
            f"unmapped key(s) for {config.model_type} in {layout.dist_ckpt_dir}: {quoted(unmapped)}. "
            "Add them to HF_FROM_MEGATRON (or TABLES_BY_MODEL_TYPE) in mergeflow/megatron.py."
        )
    tensor_parallel = _tensor_parallel(stored)
    return MegatronIndex(
        checkpoint_dir=layout.checkpoint_dir,
        dist_ckpt_dir=layout.dist_ckpt_dir,
        world_size=layout.world_size,
        tensor_parallel=tensor_parallel,
        mesh_shape=(tensor_parallel,) if tensor_parallel else (),
        mesh_dim_names=("tp",) if tensor_parallel else None,
        tensors=tensors,
        stored=stored,
        geometry=geometry,
        aliases={},
    )


def mapping_table(model_type: str) -> dict[str, list[tuple[str, str]]]:
    """mcore key template -> the HF tensors it holds, for one model type."""
    return {**HF_FROM_MEGATRON, **TABLES_BY_MODEL_TYPE.get(model_type, {})}


def _geometry(config) -> Geometry:
    return Geometry(
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_query_groups=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        vocab_size=config.vocab_size,
        num_experts=getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0,
    )


def _targets(template: str, table: dict[str, list[tuple[str, str]]]) -> list[tuple[str, str]] | None:
    """The HF tensors of a key template; a `_w`/`_v` half of a fused gate|up is its gate or up tensor."""
    if template in table:
        return table[template]
    half = GLU_HALF.match(template)
    fused = table.get(half[1]) if half else None
    if fused is None or [part for _, part in fused] != [GATE, UP]:
        return None
    gate, up = fused
    return [(gate[0] if half[2] == "w" else up[0], COPY)]


def _locate(key: str, entry: StoredTensor, geometry: Geometry) -> tuple[str, list[tuple[tuple[int, ...], dict[str, int]]]]:
    """The table template of a stored key, and each (layer, expert) it holds: the indices into its stacked
    axes and the fields that name the HF tensor.

    Raises:
        PlanError: a stacked axis whose length is not the config's number of layers or experts.
    """
    layers = LAYERS.match(key)
    if layers is None:
        return key, [((), {})]
    rest = key[layers.end() :]
    fields: dict[str, int] = {}
    stacked: list[tuple[str, int]] = []
    if layers[1] is not None:
        fields["layer"] = int(layers[1])
    else:
        stacked.append(("layer", geometry.num_layers))
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
    return f"decoder.layers.{{layer}}.{rest}", placements


def _part_shape(part: str, shape: tuple[int, ...], geometry: Geometry, key: str) -> tuple[int, ...]:
    rows, tail = shape[0], shape[1:]
    if part in (Q, K, V):
        per_group = geometry.num_heads // geometry.num_query_groups
        expected = geometry.num_query_groups * (per_group + 2) * geometry.head_dim
        if rows != expected:
            raise PlanError(
                f"{key} has {rows} rows, but {geometry.num_heads} heads in {geometry.num_query_groups} query "
                f"groups of head_dim {geometry.head_dim} make {expected}"
            )
        heads = per_group * geometry.num_query_groups if part == Q else geometry.num_query_groups
        return (heads * geometry.head_dim, *tail)
    if part in (GATE, UP):
        return (rows // 2, *tail)
    if part == VOCAB:
        return (min(rows, geometry.vocab_size), *tail)
    return shape


def _tensor_parallel(stored: dict[str, StoredTensor]) -> int | None:
    """TP size, from how one layer's attention output projection is split (by input columns)."""
    key = next((key for key in sorted(stored) if key.endswith("self_attention.linear_proj.weight")), None)
    if key is None:
        return None
    return sum(1 for chunk in stored[key].chunks if not any(chunk.offsets[:-1]))


def split_part(value: torch.Tensor, part: str, geometry: Geometry) -> torch.Tensor:
    """The HF tensor `part` of one layer of a stored tensor."""
    if part == COPY:
        return value
    if part == VOCAB:
        return value[: geometry.vocab_size]
    if part in (GATE, UP):
        half = value.shape[0] // 2
        return value[:half] if part == GATE else value[half:]
    per_group = geometry.num_heads // geometry.num_query_groups
    groups = value.reshape(geometry.num_query_groups, per_group + 2, geometry.head_dim, *value.shape[1:])
    picked = {Q: groups[:, :per_group], K: groups[:, per_group], V: groups[:, per_group + 1]}[part]
    return picked.reshape(-1, *value.shape[1:])


class MegatronTensors:
    """Reads planned tensors out of the archive, one stored layer (or expert) at a time, the last few kept
    so that the parts of a fused tensor (QKV, gate|up) cost one read."""

    CACHED_SLICES = 4

    def __init__(self, index: MegatronIndex):
        self._index = index
        self._cache: OrderedDict[tuple[str, tuple[int, ...]], torch.Tensor] = OrderedDict()

    def _stored(self, key: str, leading: tuple[int, ...]) -> torch.Tensor:
        cached = self._cache.get((key, leading))
        if cached is not None:
            self._cache.move_to_end((key, leading))
            return cached
        value = read_slice(Path(self._index.dist_ckpt_dir), self._index.stored[key], leading)
        self._cache[key, leading] = value
        if len(self._cache) > self.CACHED_SLICES:
            self._cache.popitem(last=False)
        return value

    def whole(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        tensor = self._index.tensors[name]
        return split_part(self._stored(tensor.key, tensor.leading), tensor.part, self._index.geometry).to(dtype)

    def chunks(self, output, chunk_bytes: int) -> Iterator[torch.Tensor]:
        value = self.whole(output.source, parse_dtype_name(output.dtype)).contiguous()
        if not value.dim():
            yield value
            return
        row_bytes = max(1, value[0].numel() * value.element_size())
        step = max(1, chunk_bytes // row_bytes)
        for start in range(0, max(value.shape[0], 1), step):
            yield value[start : start + step]

    def rows(self, output, start: int, stop: int) -> torch.Tensor:
        value = self.whole(output.source, parse_dtype_name(output.dtype))
        return value if not value.dim() else value[start:stop]

    def verify(self) -> None:
        """Nothing left to check: each chunk is checked against its CRC-32 as it is loaded (`dcp.load_chunk`)."""

    def close(self) -> None:
        self._cache.clear()
