"""Qwen3-VL (and Qwen3-VL-MoE) for the Megatron fixture writer, in the layout derived from Megatron-Bridge's source.

verl trains Qwen3-VL on Megatron as Megatron-Bridge's `Qwen3VLModel`, which needs Python 3.12 and a megatron-core
newer than any that installs here. So the fixture is that model's module tree rebuilt from megatron-core 0.16.1's
own layers, under Megatron-Bridge's module names: megatron-core's GPTModel as `language_model`, and a
`vision_model` with `patch_embed`, `pos_embed`, a `decoder` of vision blocks with its `deepstack_merger_list`
(saved stacked, as Megatron-Bridge's block saves it), and `merger`. megatron-core saves it; the values are placed
as Megatron-Bridge's `Qwen3VLBridge` maps the HF weights (`BRIDGE_VISION_NAMES`, vision QKV interleaved per head).
"""

import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

from tests.writers.megatron_vision import vision_tower_shape

QWEN3_VL_MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe")
TE_NORM_KEYS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_", "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
"""The names Transformer Engine's fused norm+linear layers (which Megatron-Bridge builds) give the norms."""
BRIDGE_VISION_NAMES = {
    "patch_embed.proj.weight": "patch_embed.proj.weight",
    "patch_embed.proj.bias": "patch_embed.proj.bias",
    "pos_embed.weight": "pos_embed.weight",
    "decoder.layers.{}.self_attention.linear_qkv.layer_norm_weight": "blocks.{}.norm1.weight",
    "decoder.layers.{}.self_attention.linear_qkv.layer_norm_bias": "blocks.{}.norm1.bias",
    "decoder.layers.{}.self_attention.linear_qkv.weight": "blocks.{}.attn.qkv.weight",
    "decoder.layers.{}.self_attention.linear_qkv.bias": "blocks.{}.attn.qkv.bias",
    "decoder.layers.{}.self_attention.linear_proj.weight": "blocks.{}.attn.proj.weight",
    "decoder.layers.{}.self_attention.linear_proj.bias": "blocks.{}.attn.proj.bias",
    "decoder.layers.{}.mlp.linear_fc1.layer_norm_weight": "blocks.{}.norm2.weight",
    "decoder.layers.{}.mlp.linear_fc1.layer_norm_bias": "blocks.{}.norm2.bias",
    "decoder.layers.{}.mlp.linear_fc1.weight": "blocks.{}.mlp.linear_fc1.weight",
    "decoder.layers.{}.mlp.linear_fc1.bias": "blocks.{}.mlp.linear_fc1.bias",
    "decoder.layers.{}.mlp.linear_fc2.weight": "blocks.{}.mlp.linear_fc2.weight",
    "decoder.layers.{}.mlp.linear_fc2.bias": "blocks.{}.mlp.linear_fc2.bias",
    "decoder.deepstack_merger_list.{}.patch_norm.weight": "deepstack_merger_list.{}.norm.weight",
    "decoder.deepstack_merger_list.{}.patch_norm.bias": "deepstack_merger_list.{}.norm.bias",
    "decoder.deepstack_merger_list.{}.linear_fc1.weight": "deepstack_merger_list.{}.linear_fc1.weight",
    "decoder.deepstack_merger_list.{}.linear_fc1.bias": "deepstack_merger_list.{}.linear_fc1.bias",
    "decoder.deepstack_merger_list.{}.linear_fc2.weight": "deepstack_merger_list.{}.linear_fc2.weight",
    "decoder.deepstack_merger_list.{}.linear_fc2.bias": "deepstack_merger_list.{}.linear_fc2.bias",
    "merger.patch_norm.weight": "merger.norm.weight",
    "merger.patch_norm.bias": "merger.norm.bias",
    "merger.linear_fc1.weight": "merger.linear_fc1.weight",
    "merger.linear_fc1.bias": "merger.linear_fc1.bias",
    "merger.linear_fc2.weight": "merger.linear_fc2.weight",
    "merger.linear_fc2.bias": "merger.linear_fc2.bias",
}
"""Megatron-Bridge's `Qwen3VLBridge.mapping_registry`, vision side: key under `vision_model.` → HF name under
`model.visual.` (`{}`: a block's or a DeepStack merger's index)."""
STACKED = re.compile(r"^(vision_model\.decoder\.(?:layers|deepstack_merger_list)\.)(?!\d)")
INDEX = re.compile(r"\.(\d+)\.")


def deepstack_indexes(vision) -> list[int]:
    """The vision blocks a DeepStack merger follows (none in Qwen3.5's tower)."""
    return getattr(vision, "deepstack_visual_indexes", None) or []


class Qwen3VLStandIn(MegatronModule):
    """Megatron-Bridge's `Qwen3VLModel` as a checkpoint sees it: its language model and vision tower."""

    def __init__(self, language_model: MegatronModule, vision_model: MegatronModule):
        super().__init__(language_model.config)
        self.language_model = language_model
        self.vision_model = vision_model


class VisionTower(MegatronModule):
    """Megatron-Bridge's `Qwen3VLVisionModel`'s modules (it is never run here)."""

    def __init__(self, config: TransformerConfig, vision):
        super().__init__(config)
        kernel = (vision.temporal_patch_size, vision.patch_size, vision.patch_size)
        self.patch_embed = torch.nn.Module()
        self.patch_embed.proj = torch.nn.Conv3d(vision.in_channels, vision.hidden_size, kernel, stride=kernel)
        self.pos_embed = torch.nn.Embedding(vision.num_position_embeddings, vision.hidden_size)
        layer = get_vit_layer_with_local_spec()
        layer.submodules.sharded_state_dict_keys_map = TE_NORM_KEYS
        self.decoder = TransformerBlock(config, layer, post_layer_norm=False)
        self.decoder.deepstack_merger_list = StackedMergers(
            PatchMerger(config, vision, norm_after_merging=True) for _ in deepstack_indexes(vision)
        )
        self.merger = PatchMerger(config, vision, norm_after_merging=False)


class PatchMerger(MegatronModule):
    """A norm, then two linear layers over each 2x2 group of patches (Megatron-Bridge's `Qwen3VLVisionPatchMerger`)."""

    def __init__(self, config: TransformerConfig, vision, *, norm_after_merging: bool):
        super().__init__(config)
        merged = vision.hidden_size * vision.spatial_merge_size**2
        self.patch_norm = torch.nn.LayerNorm(merged if norm_after_merging else vision.hidden_size, eps=1e-6)
        self.linear_fc1 = ColumnParallelLinear(
            merged, merged, config=config, init_method=config.init_method, bias=True, gather_output=False
        )
        self.linear_fc2 = RowParallelLinear(
            merged,
            vision.out_hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=True,
            input_is_parallel=True,
            skip_bias_add=False,
        )


class StackedMergers(torch.nn.ModuleList):
    """The DeepStack mergers, saved as Megatron-Bridge's vision block saves them: stacked on a leading axis."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        state = {}
        for index, merger in enumerate(self):
            one = merger.sharded_state_dict(f"{prefix}{index}.", (*sharded_offsets, (0, index, len(self))), metadata)
            replace_prefix_for_sharding(one, f"{prefix}{index}.", prefix)
            state |= one
        return state


def build_qwen3_vl_model(config, language_model: MegatronModule, language_fields: dict) -> Qwen3VLStandIn:
    """The stand-in for Megatron-Bridge's model: `language_model` beside a vision tower sized by the HF config."""
    vision = config.vision_config
    vision_fields = language_fields | vision_tower_shape(vision) | {
        "gated_linear_unit": False,
        "activation_func": F.gelu,
        "normalization": "LayerNorm",
        "layernorm_epsilon": 1e-6,
        "add_bias_linear": True,
        "add_qkv_bias": True,
        "qk_layernorm": False,
        "bias_activation_fusion": False,
        "pipeline_model_parallel_size": 1,
        "mtp_num_layers": None,
    }
    return Qwen3VLStandIn(language_model, VisionTower(TransformerConfig(**vision_fields), vision))


def text_weights(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """The language model's HF tensors as a text-only Qwen3 (MoE) checkpoint names them: `model.*`, one tensor per
    expert (Qwen3-VL-MoE holds its experts input-major, all of a layer's in one tensor)."""
    text = {
        name.replace("model.language_model.", "model.", 1): tensor
        for name, tensor in state.items()
        if not name.startswith("model.visual.")
    }
    for name in [name for name in text if name.endswith("mlp.experts.gate_up_proj")]:
        layer = name.removesuffix("gate_up_proj")
        gate_up, down = text.pop(name), text.pop(f"{layer}down_proj")
        for expert in range(gate_up.shape[0]):
            gate, up = gate_up[expert].T.chunk(2)
            text |= {
                f"{layer}{expert}.gate_proj.weight": gate,
                f"{layer}{expert}.up_proj.weight": up,
                f"{layer}{expert}.down_proj.weight": down[expert].T,
            }
    return text


def qwen3_vl_values(
    state: dict[str, torch.Tensor], config, language_values: Callable[[str], torch.Tensor]
) -> Callable[[str], torch.Tensor]:
    """The global value of any key: the language model's from `language_values`, the vision tower's as
    Megatron-Bridge converts the HF weights (QKV from HF's [all q; all k; all v] to [q, k, v] per head)."""
    vision = config.vision_config
    head_dim = vision.hidden_size // vision.num_heads
    counts = {"layers": vision.depth, "deepstack_merger_list": len(deepstack_indexes(vision))}

    def one(key: str) -> torch.Tensor:
        index = INDEX.search(key)
        template = key if index is None else f"{key[: index.start()]}.{{}}.{key[index.end() :]}"
        name = BRIDGE_VISION_NAMES[template.removeprefix("vision_model.")]
        value = state[f"model.visual.{name.format(index[1] if index else '')}"]
        if "linear_qkv" in key and "layer_norm" not in key:
            return value.reshape(3, vision.num_heads, head_dim, *value.shape[1:]).transpose(0, 1).reshape(value.shape)
        return value

    def value(key: str) -> torch.Tensor:
        if key.startswith("language_model."):
            return language_values(key.removeprefix("language_model."))
        stacked = STACKED.match(key)
        if stacked is None:
            return one(key)
        count = counts[stacked[1].split(".")[2]]
        return torch.stack([one(f"{stacked[1]}{i}.{key[stacked.end() :]}") for i in range(count)])

    return value
