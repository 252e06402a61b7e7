"""Qwen3.5 (and Qwen3.5-MoE) and Qwen3-Next for the Megatron fixture writer: the language model is megatron-core's
own hybrid decoder (its gated delta net layers between attention layers with an output gate, zero-centred norms),
built from megatron-core 0.16.1's modules as Megatron-Bridge configures it for them; Qwen3.5's vision tower is
Qwen3-VL's stand-in (`tests.writers.megatron_qwen3_vl`). The HF weights are placed as Megatron-Bridge's
`Qwen35VLBridge` and `Qwen3NextBridge` map them (read from its source: it cannot run here).

megatron-core builds these layers only from Transformer Engine's, which need CUDA: here megatron-core's local
layers stand in, with the parameter names Transformer Engine's fused norm + linear layers save
(`linear_qkv.layer_norm_weight`, `in_proj.layer_norm_weight`), and a zero-centred RMSNorm. Its gated delta rule
runs in its own torch implementation (`deterministic_mode`), so the `fla` package it asks for (its GPU kernels) is
not needed; `l2norm`, which it takes from `fla`, is the formula transformers uses in its place.
"""

import re
from collections.abc import Callable

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec_for_backend
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.ssm import gated_delta_net
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from tests.writers.megatron import fused_qkv

QWEN3_5_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
LAYER = re.compile(r"^(?:decoder\.layers\.(\d+)\.|mtp\.layers\.(\d+)\.transformer_layer\.)")
"""One decoder layer's key, or an MTP layer's decoder layer's (the layer after the decoder's)."""
HYBRID_TEXT_MODEL_TYPES = ("qwen3_next",)
"""Text models with the same decoder (Qwen3-Next), whose gated delta net projections HF groups per key head."""


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm whose scale is 1 + weight (`layernorm_zero_centered_gamma`), in float32 as transformers computes it."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_normed(x, self.weight, self.eps)


class NormThenColumnParallelLinear(ColumnParallelLinear):
    """Transformer Engine's fused norm + column-parallel linear layer, under its names: the norm's scale is the
    layer's `layer_norm_weight`."""

    def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.eps = config.layernorm_epsilon
        self.layer_norm_weight = torch.nn.Parameter(torch.zeros(input_size))

    def forward(self, x: torch.Tensor, *args, **kwargs):
        return super().forward(rms_normed(x, self.layer_norm_weight, self.eps), *args, **kwargs)


def rms_normed(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).type_as(x)


def hybrid_fields(text) -> dict:
    """TransformerConfig fields for Qwen3.5's decoder beyond a Qwen3 one's, as Megatron-Bridge sets them."""
    return {
        "layernorm_zero_centered_gamma": True,
        "attention_output_gate": True,
        "experimental_attention_variant": "gated_delta_net",
        "linear_attention_freq": [int(kind == "linear_attention") for kind in text.layer_types],
        "linear_conv_kernel_dim": text.linear_conv_kernel_dim,
        "linear_key_head_dim": text.linear_key_head_dim,
        "linear_value_head_dim": text.linear_value_head_dim,
        "linear_num_key_heads": text.linear_num_key_heads,
        "linear_num_value_heads": text.linear_num_value_heads,
        "deterministic_mode": True,
        "perform_initialization": False,  # every weight is copied in; its initializer forks the CUDA RNG
    }


def hybrid_block_spec(config: TransformerConfig) -> TransformerBlockSubmodules:
    """The decoder's layers: a gated delta net where `linear_attention_freq` says, attention elsewhere; MoE where
    the config has experts."""
    gated_delta_net.HAVE_FLA = True  # only its kernels need `fla`; deterministic_mode runs megatron-core's torch rule
    gated_delta_net.l2norm = l2norm
    linear = ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(
            in_proj=NormThenColumnParallelLinear, out_norm=ZeroCenteredRMSNorm, out_proj=RowParallelLinear
        ),
    )
    attention = ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=NormThenColumnParallelLinear,
            core_attention=DotProductAttention,
            linear_proj=RowParallelLinear,
            q_layernorm=ZeroCenteredRMSNorm,
            k_layernorm=ZeroCenteredRMSNorm,
        ),
    )
    if config.num_moe_experts:
        mlp = get_moe_module_spec_for_backend(LocalSpecProvider(), num_experts=config.num_moe_experts, moe_grouped_gemm=False)
        pre_mlp_layernorm = ZeroCenteredRMSNorm
    else:
        mlp = ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=NormThenColumnParallelLinear, linear_fc2=RowParallelLinear))
        pre_mlp_layernorm = IdentityOp
    layers = [
        ModuleSpec(
            module=TransformerLayer,
            submodules=TransformerLayerSubmodules(
                input_layernorm=IdentityOp,
                self_attention=linear if is_linear else attention,
                self_attn_bda=get_bias_dropout_add,
                pre_mlp_layernorm=pre_mlp_layernorm,
                mlp=mlp,
                mlp_bda=get_bias_dropout_add,
            ),
        )
        for is_linear in config.linear_attention_freq
    ]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=ZeroCenteredRMSNorm)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """transformers' stand-in for `fla`'s l2norm."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class ZeroCenteredNorms(LocalSpecProvider):
    """megatron-core's local layers, with the zero-centred RMSNorm (for the MTP layer's norms)."""

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        return ZeroCenteredRMSNorm


def build_hybrid_language_model(text, config: TransformerConfig) -> GPTModel:
    """The hybrid decoder, with its MTP layer (shaped as its last layer) when the config has one."""
    block = hybrid_block_spec(config)
    return GPTModel(
        config,
        transformer_layer_spec=block,
        mtp_block_spec=get_gpt_mtp_block_spec_for_backend(config, block, backend=ZeroCenteredNorms())
        if config.mtp_num_layers
        else None,
        vocab_size=text.vocab_size,
        max_sequence_length=text.max_position_embeddings,
        share_embeddings_and_output_weights=text.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=text.rope_parameters["rope_theta"],
        rotary_percent=text.rope_parameters.get("partial_rotary_factor", 1.0),
    )


def hybrid_values(
    text_state: dict[str, torch.Tensor], text, dense_values: Callable[[str], torch.Tensor]
) -> Callable[[str], torch.Tensor]:
    """The global value of a language-model key: a gated delta net's or a gated attention's from the HF weights
    (`model.*` names) as Megatron-Bridge converts them, every other from `dense_values`."""
    key_dim = text.linear_key_head_dim * text.linear_num_key_heads
    pieces = {"query": slice(0, key_dim), "key": slice(key_dim, 2 * key_dim), "value": slice(2 * key_dim, None)}
    heads, groups, head_dim = text.num_attention_heads, text.num_key_value_heads, text.head_dim

    def gated_qkv(layer: str) -> torch.Tensor:
        """Megatron-core's per query group [queries, their gates, key, value], from HF's per head [query, gate]."""
        query_and_gate = text_state[f"{layer}self_attn.q_proj.weight"].reshape(heads, 2, head_dim, -1)
        per_group = [part.reshape(groups, heads // groups * head_dim, -1) for part in query_and_gate.unbind(1)]
        queries = torch.cat(per_group, dim=1).reshape(2 * heads * head_dim, -1)
        k, v = (text_state[f"{layer}self_attn.{p}_proj.weight"] for p in "kv")
        return fused_qkv(queries, k, v, groups)

    def one_layer(layer: str, name: str) -> torch.Tensor | None:
        attention = f"{layer}linear_attn."
        if name == "self_attention.linear_qkv.weight":
            return gated_qkv(layer)
        if name == "self_attention.in_proj.layer_norm_weight":
            return text_state[f"{layer}input_layernorm.weight"]
        if name.startswith("self_attention.in_proj.weight."):
            piece = name.rpartition(".")[2]
            if piece in pieces:
                return text_state[f"{attention}in_proj_qkv.weight"][pieces[piece]]
            return text_state[f"{attention}in_proj_{ {'z': 'z', 'beta': 'b', 'alpha': 'a'}[piece]}.weight"]
        if name.startswith("self_attention.conv1d.weight."):
            return text_state[f"{attention}conv1d.weight"][pieces[name.rpartition(".")[2]]]
        if name in ("self_attention.A_log", "self_attention.dt_bias", "self_attention.out_proj.weight"):
            return text_state[f"{attention}{name.removeprefix('self_attention.')}"]
        if name == "self_attention.out_norm.weight":
            return text_state[f"{attention}norm.weight"] - 1
        return None

    def value(key: str) -> torch.Tensor:
        layer = LAYER.match(key)
        if layer is None:
            return dense_values(key)
        index = int(layer[1]) if layer[1] is not None else text.num_hidden_layers + int(layer[2])
        own = one_layer(f"model.layers.{index}.", key[layer.end() :])
        return dense_values(key) if own is None else own

    return value


def projections_apart(state: dict[str, torch.Tensor], text) -> dict[str, torch.Tensor]:
    """Qwen3-Next's weights with each gated delta net's projections as Qwen3.5 holds them (`in_proj_qkv`,
    `in_proj_z`, `_b`, `_a`), ungrouped from its per-key-head `in_proj_qkvz` and `in_proj_ba` as transformers'
    `fix_query_key_value_ordering` reads them."""
    key_heads, key_dim = text.linear_num_key_heads, text.linear_key_head_dim
    per_key_head = text.linear_num_value_heads // key_heads * text.linear_value_head_dim
    apart = dict(state)
    for name in [name for name in state if name.endswith("linear_attn.in_proj_qkvz.weight")]:
        attention = name.removesuffix("in_proj_qkvz.weight")
        qkvz = apart.pop(name).reshape(key_heads, -1, text.hidden_size)
        q, k, v, z = (part.reshape(-1, text.hidden_size) for part in qkvz.split([key_dim, key_dim, per_key_head, per_key_head], dim=1))
        b, a = (part.reshape(-1, text.hidden_size) for part in apart.pop(f"{attention}in_proj_ba.weight").reshape(key_heads, 2, -1, text.hidden_size).unbind(1))
        apart |= {
            f"{attention}in_proj_qkv.weight": torch.cat([q, k, v]),
            f"{attention}in_proj_z.weight": z,
            f"{attention}in_proj_b.weight": b,
            f"{attention}in_proj_a.weight": a,
        }
    return apart


def mtp_as_deepseek_names(state: dict[str, torch.Tensor], text) -> dict[str, torch.Tensor]:
    """The weights with the MTP layer's tensors under the names of DeepSeek-V3's (which the worker reads): its
    decoder layer `model.layers.{num_hidden_layers + k}.*`, and `mtp.fc`, `mtp.pre_fc_norm_embedding`,
    `mtp.pre_fc_norm_hidden`, `mtp.norm` as that layer's `eh_proj`, `enorm`, `hnorm`, `shared_head.norm`."""
    last = f"model.layers.{text.num_hidden_layers}."
    own = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm", "norm": "shared_head.norm"}
    renamed = {}
    for name, tensor in state.items():
        if match := re.match(r"^mtp\.layers\.(\d+)\.", name):
            name = f"model.layers.{text.num_hidden_layers + int(match[1])}.{name[match.end() :]}"
        elif name.startswith("mtp."):
            name = f"{last}{own[name.removeprefix('mtp.').removesuffix('.weight')]}.weight"
        renamed[name] = tensor
    return renamed
