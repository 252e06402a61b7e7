"""How megatron-core names a model's tensors, mapped onto the names Hugging Face's `save_pretrained` writes:
one table line per key template (`{layer}`, `{expert}`), one table per tower of a vision-language model, and
the small functions that locate a stored key's layers and experts and split its fused tensors (QKV per query
group, gate|up)."""

import itertools
import re
from dataclasses import dataclass
from typing import NamedTuple

import torch

from mergeflow.errors import PlanError
from mergeflow.formats.megatron.dcp import StoredTensor

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
ADAPTER = re.compile(r"^(?P<base>.+)\.adapter\.linear_(?P<side>in|out)\.weight$")
"""A LoRA adapter's tensor, as Megatron-Bridge's `LoRALinear` saves it beside the layer it adapts: `linear_in` is
PEFT's lora_A, `linear_out` its lora_B."""
LORA_ADAPTER_NAME = "default"
GLU_HALF = re.compile(r"^(.+)_([wv])$")
"""fc1 stored as its gate (`_w`) and up (`_v`) halves, as megatron-core writes singleton shards."""

COPY, VOCAB, Q, K, V, GATE, UP = "copy", "vocab", "q", "k", "v", "gate", "up"
QKV = "qkv"
"""A fused QKV kept fused: megatron-core's rows, [q, k, v] per query group, regrouped as [all q; all k; all v]
(the vision blocks of Qwen2.5-VL and Qwen3-VL)."""
GATE_UP_INTERLEAVED, GATE_UP_INTERLEAVED_T, TRANSPOSED = "gate_up_interleaved", "gate_up_interleaved_t", "transposed"
"""gpt-oss's expert layout: gate and up rows interleaved (and, for weights, stored input-major: transposed)."""
QKVZ_BY_KEY_HEAD, BA_BY_KEY_HEAD = "qkvz_by_key_head", "ba_by_key_head"
"""Qwen3-Next's fused gated delta net projections: megatron-core's pieces ([all q; all k; all v; all z], and
[all beta; all alpha]) regrouped per key head, as `in_proj_qkvz` and `in_proj_ba` hold them."""
ZERO_CENTERED = "zero_centered"
"""A norm weight megatron-core keeps zero-centred (its scale is 1 + weight) where the HF model keeps the scale:
the gated delta net's output norm in Qwen3.5 and Qwen3-Next."""
RANK_HALVES = "rank_halves"
"""mbridge's Qwen2.5-VL vision projector fc1 (weight and bias). mbridge splits every `linear_fc1` across TP ranks as
gate|up when the language model is gated (`_weight_split_across_tp` consults the language model's config for every
key), this ungated one included: TP rank r holds its share of the first half of the rows, then its share of the
second half, and megatron-core saves the ranks' rows one after the other. mbridge's export joins them back
(`_weight_merge_across_tp`), and that export is what verl serves and saves: the HF rows are every rank's first
halves, then every rank's second halves. The cut needs the number of ranks, `per_rank(RANK_HALVES, ranks)`."""
PER_RANK = "/"
"""Separates a cut from the number of TP ranks it depends on (`per_rank`)."""
JOINED = "@"
"""Separates a part from the position of the piece a key holds (`joined`)."""


def joined(part: str, position: int) -> str:
    """The part of a tensor that megatron-core saves in pieces (several keys): this key holds piece `position`,
    and the pieces, joined along their rows in order, are cut as `part` says."""
    return f"{part}{JOINED}{position}"


def per_rank(part: str, ranks: int) -> str:
    """A cut that depends on how many TP ranks the stored tensor was split over (`RANK_HALVES`)."""
    return f"{part}{PER_RANK}{ranks}"


def split_per_rank(part: str) -> tuple[str, int]:
    """(cut, TP ranks), or (cut, 1) for a cut that does not depend on them."""
    part, _, ranks = part.partition(PER_RANK)
    return part, int(ranks) if ranks else 1


def split_joined(part: str) -> tuple[str, int | None]:
    """(part, position of the piece), or (part, None) for a tensor saved whole."""
    part, _, position = part.partition(JOINED)
    return part, int(position) if position else None


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
"""DeepSeek-V3's (and GLM-4.5's) router with its expert bias (aux-loss-free balancing) and their ungated
shared experts."""

MTP: dict[str, list[tuple[str, str]]] = {
    "mtp.layers.{layer}.enorm.weight": [("model.layers.{layer}.enorm.weight", COPY)],
    "mtp.layers.{layer}.hnorm.weight": [("model.layers.{layer}.hnorm.weight", COPY)],
    "mtp.layers.{layer}.eh_proj.weight": [("model.layers.{layer}.eh_proj.weight", COPY)],
    "mtp.layers.{layer}.final_layernorm.weight": [("model.layers.{layer}.shared_head.norm.weight", COPY)],
}
"""A multi-token-prediction layer's own tensors, under the names of DeepSeek-V3's checkpoints: layer
`num_hidden_layers + k` (its decoder layer is named as the decoder's; the index adds the copies of the
embedding and the head that those checkpoints hold, `MTP_SHARED`)."""
QWEN_MTP: dict[str, list[tuple[str, str]]] = {
    "mtp.layers.{layer}.enorm.weight": [("mtp.pre_fc_norm_embedding.weight", COPY)],
    "mtp.layers.{layer}.hnorm.weight": [("mtp.pre_fc_norm_hidden.weight", COPY)],
    "mtp.layers.{layer}.eh_proj.weight": [("mtp.fc.weight", COPY)],
    "mtp.layers.{layer}.final_layernorm.weight": [("mtp.norm.weight", COPY)],
}
"""The multi-token-prediction layer of Qwen3-Next and Qwen3.5, under their checkpoints' names: its own tensors
(`mtp.fc`, its norms), and its decoder layer as `mtp.layers.{k}.*` (`MTP_UNDER_ITS_OWN_NAMES`), named within as
the decoder's layers are. It holds no copies of the embedding or the head."""
MTP_UNDER_ITS_OWN_NAMES = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_moe"})
MTP_SHARED = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}
"""An MTP layer's copies (by name in the layer) of the model's embedding and head, which megatron-core shares."""

GPT_OSS: dict[str, list[tuple[str, str]]] = {
    "decoder.layers.{layer}.self_attention.linear_proj.bias": [("model.layers.{layer}.self_attn.o_proj.bias", COPY)],
    "decoder.layers.{layer}.self_attention.core_attention.softmax_offset": [("model.layers.{layer}.self_attn.sinks", COPY)],
    "decoder.layers.{layer}.mlp.router.weight": [("model.layers.{layer}.mlp.router.weight", COPY)],
    "decoder.layers.{layer}.mlp.router.bias": [("model.layers.{layer}.mlp.router.bias", COPY)],
    "decoder.layers.{layer}.mlp.experts.{expert}.linear_fc1.weight": [
        ("model.layers.{layer}.mlp.experts.gate_up_proj", GATE_UP_INTERLEAVED_T)
    ],
    "decoder.layers.{layer}.mlp.experts.{expert}.linear_fc1.bias": [
        ("model.layers.{layer}.mlp.experts.gate_up_proj_bias", GATE_UP_INTERLEAVED)
    ],
    "decoder.layers.{layer}.mlp.experts.{expert}.linear_fc2.weight": [("model.layers.{layer}.mlp.experts.down_proj", TRANSPOSED)],
    "decoder.layers.{layer}.mlp.experts.{expert}.linear_fc2.bias": [("model.layers.{layer}.mlp.experts.down_proj_bias", COPY)],
}
"""gpt-oss: biases on the attention output and the router, attention sinks (megatron-core's learnable softmax
offset), and experts saved as one tensor per layer for all of them (a table name without `{expert}`), gate and
up interleaved, weights transposed."""

QWEN2_5_VL_VISION: dict[str, list[tuple[str, str]]] = {
    "patch_embed.proj.weight": [("visual.patch_embed.proj.weight", COPY)],
    "decoder.layers.{layer}.self_attention.linear_qkv.layer_norm_weight": [("visual.blocks.{layer}.norm1.weight", COPY)],
    "decoder.layers.{layer}.input_layernorm.weight": [("visual.blocks.{layer}.norm1.weight", COPY)],
    "decoder.layers.{layer}.self_attention.linear_qkv.weight": [("visual.blocks.{layer}.attn.qkv.weight", QKV)],
    "decoder.layers.{layer}.self_attention.linear_qkv.bias": [("visual.blocks.{layer}.attn.qkv.bias", QKV)],
    "decoder.layers.{layer}.self_attention.linear_proj.weight": [("visual.blocks.{layer}.attn.proj.weight", COPY)],
    "decoder.layers.{layer}.self_attention.linear_proj.bias": [("visual.blocks.{layer}.attn.proj.bias", COPY)],
    "decoder.layers.{layer}.mlp.linear_fc1.layer_norm_weight": [("visual.blocks.{layer}.norm2.weight", COPY)],
    "decoder.layers.{layer}.pre_mlp_layernorm.weight": [("visual.blocks.{layer}.norm2.weight", COPY)],
    "decoder.layers.{layer}.mlp.linear_fc1.weight": [
        ("visual.blocks.{layer}.mlp.gate_proj.weight", GATE),
        ("visual.blocks.{layer}.mlp.up_proj.weight", UP),
    ],
    "decoder.layers.{layer}.mlp.linear_fc1.bias": [
        ("visual.blocks.{layer}.mlp.gate_proj.bias", GATE),
        ("visual.blocks.{layer}.mlp.up_proj.bias", UP),
    ],
    "decoder.layers.{layer}.mlp.linear_fc2.weight": [("visual.blocks.{layer}.mlp.down_proj.weight", COPY)],
    "decoder.layers.{layer}.mlp.linear_fc2.bias": [("visual.blocks.{layer}.mlp.down_proj.bias", COPY)],
    "decoder.final_layernorm.weight": [("visual.merger.ln_q.weight", COPY)],
    "projection.encoder.linear_fc1.weight": [("visual.merger.mlp.0.weight", RANK_HALVES)],
    "projection.encoder.linear_fc1.bias": [("visual.merger.mlp.0.bias", RANK_HALVES)],
    "projection.encoder.linear_fc2.weight": [("visual.merger.mlp.2.weight", COPY)],
    "projection.encoder.linear_fc2.bias": [("visual.merger.mlp.2.bias", COPY)],
}
"""Qwen2.5-VL's vision tower, `vision_model.` in verl's (mbridge's) model: biases on every linear layer, RMSNorms,
QKV fused as the HF model keeps it, and the patch merger (`ln_q`, then megatron-core's two-layer projector, whose fc1
mbridge splits over TP ranks as it would a gate|up: `RANK_HALVES`). Megatron-Bridge's Qwen2.5-VL (verl's default
bridge) keeps HF's own vision module under `visual.*`, replicated, not split: its archives need no such cut."""
QWEN3_VL_VISION: dict[str, list[tuple[str, str]]] = {
    "patch_embed.proj.weight": [("model.visual.patch_embed.proj.weight", COPY)],
    "patch_embed.proj.bias": [("model.visual.patch_embed.proj.bias", COPY)],
    "pos_embed.weight": [("model.visual.pos_embed.weight", COPY)],
    **{
        f"decoder.layers.{{layer}}.{norm}{kind}": [(f"model.visual.blocks.{{layer}}.{hf_norm}.{kind}", COPY)]
        for norm, hf_norm in (
            ("self_attention.linear_qkv.layer_norm_", "norm1"),
            ("input_layernorm.", "norm1"),
            ("mlp.linear_fc1.layer_norm_", "norm2"),
            ("pre_mlp_layernorm.", "norm2"),
        )
        for kind in ("weight", "bias")
    },
    "decoder.layers.{layer}.self_attention.linear_qkv.weight": [("model.visual.blocks.{layer}.attn.qkv.weight", QKV)],
    "decoder.layers.{layer}.self_attention.linear_qkv.bias": [("model.visual.blocks.{layer}.attn.qkv.bias", QKV)],
    "decoder.layers.{layer}.self_attention.linear_proj.weight": [("model.visual.blocks.{layer}.attn.proj.weight", COPY)],
    "decoder.layers.{layer}.self_attention.linear_proj.bias": [("model.visual.blocks.{layer}.attn.proj.bias", COPY)],
    **{
        f"{megatron}.{linear}.{kind}": [(f"{hf}.{linear}.{kind}", COPY)]
        for megatron, hf in (
            ("decoder.layers.{layer}.mlp", "model.visual.blocks.{layer}.mlp"),
            ("decoder.deepstack_merger_list.{index}", "model.visual.deepstack_merger_list.{index}"),
            ("merger", "model.visual.merger"),
        )
        for linear in ("linear_fc1", "linear_fc2")
        for kind in ("weight", "bias")
    },
    **{
        f"{megatron}.patch_norm.{kind}": [(f"{hf}.norm.{kind}", COPY)]
        for megatron, hf in (
            ("decoder.deepstack_merger_list.{index}", "model.visual.deepstack_merger_list.{index}"),
            ("merger", "model.visual.merger"),
        )
        for kind in ("weight", "bias")
    },
}
"""Qwen3-VL's vision tower, `vision_model.` in Megatron-Bridge's model: LayerNorms with biases (Transformer Engine's
fused names or the plain ones), an ungated MLP, a learned position embedding, and the patch merger and DeepStack
mergers, each a norm and two linear layers."""
QWEN3_VL_MOE_EXPERTS: dict[str, list[tuple[str, str]]] = {
    "decoder.layers.{layer}.mlp.router.weight": [("model.layers.{layer}.mlp.gate.weight", COPY)],
    "decoder.layers.{layer}.mlp.experts.{expert}.linear_fc1.weight": [("model.layers.{layer}.mlp.experts.gate_up_proj", TRANSPOSED)],
    "decoder.layers.{layer}.mlp.experts.{expert}.linear_fc2.weight": [("model.layers.{layer}.mlp.experts.down_proj", TRANSPOSED)],
}
"""Qwen3-VL-MoE's experts as its checkpoints hold them (and vLLM reads them), one tensor per layer for all of them,
input-major: `gate_up_proj` (experts, hidden, 2·ffn), gate then up, and `down_proj` (experts, ffn, hidden)."""
GATED_DELTA_NET: dict[str, list[tuple[str, str]]] = {
    "decoder.layers.{layer}.self_attention.in_proj.layer_norm_weight": [
        ("model.layers.{layer}.input_layernorm.weight", COPY)
    ],
    **{
        f"decoder.layers.{{layer}}.self_attention.in_proj.weight.{piece}": [
            ("model.layers.{layer}.linear_attn.in_proj_qkv.weight", joined(COPY, position))
        ]
        for position, piece in enumerate(("query", "key", "value"))
    },
    **{
        f"decoder.layers.{{layer}}.self_attention.conv1d.weight.{piece}": [
            ("model.layers.{layer}.linear_attn.conv1d.weight", joined(COPY, position))
        ]
        for position, piece in enumerate(("query", "key", "value"))
    },
    **{
        f"decoder.layers.{{layer}}.self_attention.in_proj.weight.{piece}": [
            (f"model.layers.{{layer}}.linear_attn.in_proj_{hf}.weight", COPY)
        ]
        for piece, hf in (("z", "z"), ("beta", "b"), ("alpha", "a"))
    },
    "decoder.layers.{layer}.self_attention.A_log": [("model.layers.{layer}.linear_attn.A_log", COPY)],
    "decoder.layers.{layer}.self_attention.dt_bias": [("model.layers.{layer}.linear_attn.dt_bias", COPY)],
    "decoder.layers.{layer}.self_attention.out_norm.weight": [("model.layers.{layer}.linear_attn.norm.weight", ZERO_CENTERED)],
    "decoder.layers.{layer}.self_attention.out_proj.weight": [("model.layers.{layer}.linear_attn.out_proj.weight", COPY)],
}
"""megatron-core's gated delta net (the linear attention layers of Qwen3.5), as Qwen3.5 names it: the input
projection saved in pieces (`in_proj.weight.query`, `.key`, `.value`, `.z`, `.beta`, `.alpha`; q, k and v joined
into `in_proj_qkv`), the causal convolution likewise, and the output norm, which megatron-core keeps zero-centred."""
QWEN3_NEXT_GATED_DELTA_NET: dict[str, list[tuple[str, str]]] = {
    **GATED_DELTA_NET,
    **{
        f"decoder.layers.{{layer}}.self_attention.in_proj.weight.{piece}": [
            ("model.layers.{layer}.linear_attn.in_proj_qkvz.weight", joined(QKVZ_BY_KEY_HEAD, position))
        ]
        for position, piece in enumerate(("query", "key", "value", "z"))
    },
    **{
        f"decoder.layers.{{layer}}.self_attention.in_proj.weight.{piece}": [
            ("model.layers.{layer}.linear_attn.in_proj_ba.weight", joined(BA_BY_KEY_HEAD, position))
        ]
        for position, piece in enumerate(("beta", "alpha"))
    },
}
"""Qwen3-Next's gated delta net: Qwen3.5's, but with its input projection in two tensors grouped per key head."""
LANGUAGE_MODEL, VISION_MODEL = "language_model.", "vision_model."
"""What the keys of each tower of a vision-language model start with."""


def language_model_under(prefix: str, table: dict[str, list[tuple[str, str]]]) -> dict[str, list[tuple[str, str]]]:
    """The table with its `model.` names moved under `prefix` (Qwen3-VL's `model.language_model.`)."""
    return {
        template: [(name.replace("model.", prefix, 1) if name.startswith("model.") else name, part) for name, part in names]
        for template, names in table.items()
    }


VISION_LANGUAGE_TABLES = {
    "qwen2_5_vl": (HF_FROM_MEGATRON, QWEN2_5_VL_VISION),
    "qwen3_vl": (language_model_under("model.language_model.", HF_FROM_MEGATRON), QWEN3_VL_VISION),
    "qwen3_vl_moe": (
        language_model_under("model.language_model.", {**HF_FROM_MEGATRON, **QWEN3_VL_MOE_EXPERTS}),
        QWEN3_VL_VISION,
    ),
    "qwen3_5": (
        language_model_under("model.language_model.", {**HF_FROM_MEGATRON, **GATED_DELTA_NET, **QWEN_MTP}),
        QWEN3_VL_VISION,
    ),
    "qwen3_5_moe": (
        language_model_under("model.language_model.", {**HF_FROM_MEGATRON, **GATED_DELTA_NET, **QWEN_MOE, **QWEN_MTP}),
        QWEN3_VL_VISION,
    ),
}
"""The (language model, vision tower) tables of each vision-language model type."""
HF_MODULE_TOWERS = {"qwen2_5_vl": "visual."}
"""Vision towers that a writer keeps as Hugging Face's own module, replicated on every rank and saved under its HF
names (Megatron-Bridge's Qwen2.5-VL, verl's default bridge), by model type: the key prefix they are saved under.
An archive holds one tower or the other: mbridge's writes `vision_model.*` (`QWEN2_5_VL_VISION`)."""

TABLES_BY_MODEL_TYPE = {
    "qwen2_moe": QWEN_MOE,
    "qwen3_moe": QWEN_MOE,
    "mixtral": MIXTRAL_MOE,
    "deepseek_v3": {**MLA, **DEEPSEEK_MOE, **MTP},
    "glm4_moe": {**DEEPSEEK_MOE, **MTP},
    "gpt_oss": GPT_OSS,
    "qwen3_next": {**QWEN3_NEXT_GATED_DELTA_NET, **QWEN_MOE, **QWEN_MTP},
}
"""What a model type adds to (or overrides in) HF_FROM_MEGATRON."""
OUTPUT_GATED_TEXT_MODEL_TYPES = frozenset({"qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"})
DENSE_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
SUPPORTED_MODEL_TYPES = DENSE_MODEL_TYPES | TABLES_BY_MODEL_TYPE.keys() | VISION_LANGUAGE_TABLES.keys()
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
    num_deepstack_mergers: int = 0
    output_gate: bool = False
    linear_key_heads: int = 0
    linear_key_dim: int = 0
    """The gated delta net's key heads, and their rows in all (Qwen3-Next regroups its projections by key head)."""
    """The attention's query projection also gives a sigmoid gate on its output (Qwen3.5, Qwen3-Next): per head,
    HF keeps the gate's rows after the query's, megatron-core after a query group's."""


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
    table: dict[str, list[tuple[str, str]]]
    geometry: Geometry
    hf_names: bool = False
    """Its keys are the HF names already (`HF_MODULE_TOWERS`): each is copied under its own name."""


def components_of(config) -> list[Component]:
    """The models an archive of `config`'s model type holds, each with its key prefix, table and geometry."""
    if config.model_type not in VISION_LANGUAGE_TABLES:
        return [Component("", mapping_table(config.model_type), geometry_of(config))]
    language_table, vision_table = VISION_LANGUAGE_TABLES[config.model_type]
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
        Component(LANGUAGE_MODEL, language_table, geometry_of(config.get_text_config())),
        Component(VISION_MODEL, vision_table, vision_geometry),
    ]
    if config.model_type in HF_MODULE_TOWERS:
        components.append(Component(HF_MODULE_TOWERS[config.model_type], {}, vision_geometry, hf_names=True))
    return components


def mapping_table(model_type: str) -> dict[str, list[tuple[str, str]]]:
    """mcore key template -> the HF tensors it holds, for one model type."""
    return {**HF_FROM_MEGATRON, **TABLES_BY_MODEL_TYPE.get(model_type, {})}


def geometry_of(config) -> Geometry:
    return Geometry(
        output_gate=config.model_type in OUTPUT_GATED_TEXT_MODEL_TYPES,
        linear_key_heads=getattr(config, "linear_num_key_heads", None) or 0,
        linear_key_dim=(getattr(config, "linear_num_key_heads", None) or 0) * (getattr(config, "linear_key_head_dim", None) or 0),
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_query_groups=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        vocab_size=config.vocab_size,
        num_experts=getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0,
    )


def targets(template: str, table: dict[str, list[tuple[str, str]]]) -> list[tuple[str, str]] | None:
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


def adapter_targets(template: str, table: dict[str, list[tuple[str, str]]]) -> list[tuple[str, str]] | None:
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


def part_shape(part: str, shape: tuple[int, ...], geometry: Geometry, key: str) -> tuple[int, ...]:
    rows, tail = shape[0], shape[1:]
    if part in (Q, K, V, QKV):
        per_group = geometry.num_heads // geometry.num_query_groups
        query_rows = 2 * per_group if geometry.output_gate else per_group
        expected = geometry.num_query_groups * (query_rows + 2) * geometry.head_dim
        if rows != expected:
            raise PlanError(
                f"{key} has {rows} rows, but {geometry.num_heads} heads in {geometry.num_query_groups} query "
                f"groups of head_dim {geometry.head_dim} make {expected}"
            )
        if part == QKV:
            return shape
        heads = query_rows * geometry.num_query_groups if part == Q else geometry.num_query_groups
        return (heads * geometry.head_dim, *tail)
    if part in (GATE, UP):
        return (rows // 2, *tail)
    if part in (GATE_UP_INTERLEAVED_T, TRANSPOSED):
        return tuple(reversed(shape))
    cut, ranks = split_per_rank(part)
    if cut == RANK_HALVES and rows % (2 * ranks):
        raise PlanError(f"{key} has {rows} rows, which {ranks} TP ranks cannot each hold a share of both halves of")
    if part == VOCAB:
        return (min(rows, geometry.vocab_size), *tail)
    return shape


def split_part(value: torch.Tensor, part: str, geometry: Geometry) -> torch.Tensor:
    """The HF tensor `part` of one layer of a stored tensor."""
    if part == COPY:
        return value
    if part == VOCAB:
        return value[: geometry.vocab_size]
    if part in (GATE, UP):
        half = value.shape[0] // 2
        return value[:half] if part == GATE else value[half:]
    if part == TRANSPOSED:
        return value.T.contiguous()
    cut, ranks = split_per_rank(part)
    if cut == RANK_HALVES:
        return value.reshape(ranks, 2, -1, *value.shape[1:]).transpose(0, 1).reshape(value.shape)
    if part in (GATE_UP_INTERLEAVED, GATE_UP_INTERLEAVED_T):
        gate, up = value.chunk(2)
        interleaved = torch.stack([gate, up], dim=1).reshape(value.shape)
        return interleaved.T.contiguous() if part == GATE_UP_INTERLEAVED_T else interleaved
    if part == QKV:
        return torch.cat([split_part(value, one, geometry) for one in (Q, K, V)])
    if part == ZERO_CENTERED:
        return (value.float() + 1).to(value.dtype)
    if part in (QKVZ_BY_KEY_HEAD, BA_BY_KEY_HEAD):
        key_dim = geometry.linear_key_dim
        if part == QKVZ_BY_KEY_HEAD:
            value_dim = (value.shape[0] - 2 * key_dim) // 2
            pieces = value.split([key_dim, key_dim, value_dim, value_dim])
        else:
            pieces = value.chunk(2)
        per_head = [piece.reshape(geometry.linear_key_heads, -1, *value.shape[1:]) for piece in pieces]
        return torch.cat(per_head, dim=1).reshape(value.shape)
    per_group = geometry.num_heads // geometry.num_query_groups
    query_rows = 2 * per_group if geometry.output_gate else per_group
    groups = value.reshape(geometry.num_query_groups, query_rows + 2, geometry.head_dim, *value.shape[1:])
    if part == Q and geometry.output_gate:
        query, gate = groups[:, :per_group], groups[:, per_group:query_rows]
        return torch.stack([query, gate], dim=2).reshape(-1, *value.shape[1:])
    picked = {Q: groups[:, :per_group], K: groups[:, query_rows], V: groups[:, query_rows + 1]}[part]
    return picked.reshape(-1, *value.shape[1:])


