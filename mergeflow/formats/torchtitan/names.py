"""torchtitan's tensor names and the Hugging Face names they stand for, per model family: the mappings of
torchtitan's own state-dict adapters (`torchtitan/models/<family>/state_dict_adapter.py`, torchtitan 0.3.0), read
in reverse. A MoE layer's experts stay stacked (`w1_EFD` is every expert's gate projection) under the names of
experts stacked one projection per tensor, which planning writes one tensor per expert (`spec.stacked_experts`)."""

import re
from dataclasses import dataclass, field

from mergeflow.errors import PlanError

LAYER = re.compile(r"^layers\.(\d+)\.")
TRAINING_STATE = re.compile(r"^(?:optimizer|lr_scheduler|train_state|dataloader)\.")
"""What torchtitan saves beside the model: optimizer moments, the LR schedule, the step, the data position."""
EXPERT_BIAS = re.compile(r"^layers\.\d+\.moe\.expert_bias_E$")
"""torchtitan's load-balancing bias (added to router scores to pick experts), which the adapter leaves out:
Hugging Face's MoE models have no such tensor, so it is left out only while it is zero."""

QWEN3 = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "layers.{}.attention.qkv_linear.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.qkv_linear.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
    "layers.{}.attention.qkv_linear.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
    "layers.{}.attention.wo.weight": "model.layers.{}.self_attn.o_proj.weight",
    "layers.{}.attention.q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",
    "layers.{}.attention.k_norm.weight": "model.layers.{}.self_attn.k_norm.weight",
    "layers.{}.feed_forward.w1.weight": "model.layers.{}.mlp.gate_proj.weight",
    "layers.{}.feed_forward.w3.weight": "model.layers.{}.mlp.up_proj.weight",
    "layers.{}.feed_forward.w2.weight": "model.layers.{}.mlp.down_proj.weight",
    "layers.{}.attention_norm.weight": "model.layers.{}.input_layernorm.weight",
    "layers.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "layers.{}.moe.routed_experts.inner_experts.w1_EFD": "model.layers.{}.mlp.experts.gate_proj",
    "layers.{}.moe.routed_experts.inner_experts.w3_EFD": "model.layers.{}.mlp.experts.up_proj",
    "layers.{}.moe.routed_experts.inner_experts.w2_EDF": "model.layers.{}.mlp.experts.down_proj",
    "layers.{}.moe.router.gate.weight": "model.layers.{}.mlp.gate.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
"""torchtitan's Qwen3 adapter (`qwen3/state_dict_adapter.py`), dense and MoE."""
LLAMA3 = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "layers.{}.attention.qkv_linear.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.qkv_linear.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
    "layers.{}.attention.qkv_linear.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
    "layers.{}.attention.wo.weight": "model.layers.{}.self_attn.o_proj.weight",
    "layers.{}.feed_forward.w1.weight": "model.layers.{}.mlp.gate_proj.weight",
    "layers.{}.feed_forward.w3.weight": "model.layers.{}.mlp.up_proj.weight",
    "layers.{}.feed_forward.w2.weight": "model.layers.{}.mlp.down_proj.weight",
    "layers.{}.attention_norm.weight": "model.layers.{}.input_layernorm.weight",
    "layers.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
"""torchtitan's Llama 3 adapter (`llama3/state_dict_adapter.py`)."""


@dataclass(frozen=True)
class Family:
    """How torchtitan's adapter maps one family: its names, and the tensors whose rows it reorders."""

    table: dict[str, str]
    interleaved_rotary: dict[str, str] = field(default_factory=dict)
    """Templates whose rows torchtitan holds with each head's rotary halves interleaved (its complex RoPE), and
    the config value that counts their heads: written in Hugging Face's order, as the adapter's `_permute` does."""


FAMILIES = {
    "qwen3": Family(QWEN3),
    "qwen3_moe": Family(QWEN3),
    "llama": Family(
        LLAMA3,
        {
            "layers.{}.attention.qkv_linear.wq.weight": "num_attention_heads",
            "layers.{}.attention.qkv_linear.wk.weight": "num_key_value_heads",
        },
    ),
}
"""By Hugging Face `model_type`: the families of verl's TorchTitan engine read so far."""


def family_of(model_type: str) -> Family:
    """The family's record.

    Raises:
        PlanError: a model type with no record here.
    """
    if model_type not in FAMILIES:
        raise PlanError(
            f'model_type "{model_type}" is not read from torchtitan archives yet; supported: {", ".join(sorted(FAMILIES))}'
        )
    return FAMILIES[model_type]


def template_of(key: str) -> tuple[str, str | None]:
    """A torchtitan key as its table writes it (`layers.{}.…`), and its layer."""
    layer = LAYER.match(key)
    return (f"layers.{{}}.{key[layer.end():]}", layer[1]) if layer else (key, None)


def hf_name(key: str, table: dict[str, str]) -> str | None:
    """The Hugging Face name of a torchtitan key, or None when the table has no entry for it."""
    template, layer = template_of(key)
    name = table.get(template)
    return name.format(layer) if name and layer is not None else name
