"""megatron-core's key templates (`{layer}`, `{expert}`) mapped onto the names Hugging Face's `save_pretrained`
writes, one table per architectural piece, each line a stored key and the HF tensors it holds with their cuts
(`cuts`). Pure data: the model families (`families`) combine them."""

from mergeflow.formats.megatron.cuts import (
    BA_BY_KEY_HEAD,
    COPY,
    GATE,
    GATE_UP_INTERLEAVED,
    GATE_UP_INTERLEAVED_T,
    QKV,
    QKVZ_BY_KEY_HEAD,
    RANK_HALVES,
    TRANSPOSED,
    UP,
    VOCAB,
    ZERO_CENTERED,
    K,
    Q,
    V,
    joined,
)

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
(`mtp.fc`, its norms), and its decoder layer as `mtp.layers.{k}.*` (`Family.mtp_under_own_names`), named within as
the decoder's layers are. It holds no copies of the embedding or the head."""
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
