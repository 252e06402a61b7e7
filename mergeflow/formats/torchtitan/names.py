"""torchtitan's tensor names and the Hugging Face names they stand for, per model family: the mappings of
torchtitan's own state-dict adapters (`torchtitan/models/<family>/state_dict_adapter.py`, torchtitan 0.3.0), read
in reverse. A MoE layer's experts stay stacked (`w1_EFD` is every expert's gate projection) under the names of
experts stacked one projection per tensor, which planning writes one tensor per expert (`spec.stacked_experts`)."""

import re

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
TABLES = {"qwen3": QWEN3, "qwen3_moe": QWEN3}
"""By Hugging Face `model_type`: the families verl's TorchTitan engine trains whose adapter is a plain renaming."""


def table_of(model_type: str) -> dict[str, str]:
    """The family's table.

    Raises:
        PlanError: a model type with no table here.
    """
    if model_type not in TABLES:
        raise PlanError(
            f'model_type "{model_type}" is not read from torchtitan archives yet; supported: {", ".join(sorted(TABLES))}'
        )
    return TABLES[model_type]


def hf_name(key: str, table: dict[str, str]) -> str | None:
    """The Hugging Face name of a torchtitan key, or None when the table has no entry for it."""
    layer = LAYER.match(key)
    if layer is None:
        return table.get(key)
    template = table.get(f"layers.{{}}.{key[layer.end():]}")
    return template.format(layer[1]) if template else None
