"""The vision-language part of the Megatron fixture writer: the model verl trains Qwen2.5-VL with on its mbridge path
(mbridge's `Qwen2_5VLModel`, a megatron-core GPTModel beside a vision tower), filled by mbridge's own `load_weights`
(its Hugging Face → megatron-core conversion and its own split across TP ranks) and exported by its own
`export_weights`, so that both the archive's layout and the weights verl would serve are mbridge's and not this
project's reading of them.

mbridge builds its models from Transformer Engine layers, which need CUDA: here they are megatron-core's local
layers, with the keys Transformer Engine's would save (`linear_qkv.layer_norm_weight`), under which mbridge's name
mapping looks them up.
"""

import copy
import functools

import torch
import torch.nn.functional as F

VISION_LANGUAGE_MODEL_TYPES = ("qwen2_5_vl",)
TE_NORM_KEYS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_", "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
"""The names Transformer Engine's fused norm+linear layers give the local layers' norms in a checkpoint."""


def build_vision_language_model(config, spec: dict, language_fields: dict):
    """mbridge's Qwen2.5-VL model, its language model configured by `language_fields` and the rest sized by the
    HF config (mbridge's own vision config is the 7B model's)."""
    from mbridge.models.qwen2_5_vl.model import Qwen2_5VLModel
    from mbridge.models.qwen2_5_vl.transformer_config import Qwen2VLTransformerConfig
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules

    text, vision = config.text_config, config.vision_config
    language = Qwen2VLTransformerConfig(**language_fields, mrope_section=text.rope_parameters["mrope_section"])
    vision_config = Qwen2VLTransformerConfig(
        **language_fields
        | vision_tower_shape(vision)
        | {
            "layernorm_epsilon": 1e-6,
            "add_bias_linear": True,
            "add_qkv_bias": True,
            "bias_activation_fusion": False,
        }
    )
    for name, value in {
        "patch_size": vision.patch_size,
        "temporal_patch_size": vision.temporal_patch_size,
        "in_channels": vision.in_channels,
        "spatial_merge_size": vision.spatial_merge_size,
        "fullatt_block_indexes": vision.fullatt_block_indexes,
        "_qwen2_5_vl_window_size": vision.window_size,
        "seq_length": 1,
    }.items():
        setattr(vision_config, name, value)
    projection = Qwen2VLTransformerConfig(
        **language_fields
        | {
            "gated_linear_unit": False,
            "add_bias_linear": True,
            "bias_activation_fusion": False,
            "ffn_hidden_size": vision.hidden_size * vision.spatial_merge_size**2,
            "activation_func": F.gelu,
        }
    )
    vision_layer = get_vit_layer_with_local_spec()
    vision_layer.submodules.sharded_state_dict_keys_map = TE_NORM_KEYS
    return Qwen2_5VLModel(
        language_transformer_config=language,
        language_transformer_layer_spec=get_gpt_decoder_block_spec(
            language, use_transformer_engine=False, normalization="RMSNorm"
        ),
        language_vocab_size=text.vocab_size,
        language_max_sequence_length=text.max_position_embeddings,
        vision_transformer_config=vision_config,
        vision_transformer_layer_spec=vision_layer,
        vision_projection_config=projection,
        vision_projection_layer_spec=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        language_rotary_base=text.rope_parameters["rope_theta"],
        language_share_embeddings_and_output_weights=config.tie_word_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        image_token_id=config.image_token_id,
        video_token_id=config.video_token_id,
    )


def vision_tower_shape(vision) -> dict:
    """TransformerConfig fields for a vision tower's blocks, sized by the HF vision config (heads without groups)."""
    return {
        "num_layers": vision.depth,
        "hidden_size": vision.hidden_size,
        "num_attention_heads": vision.num_heads,
        "num_query_groups": vision.num_heads,
        "kv_channels": vision.hidden_size // vision.num_heads,
        "ffn_hidden_size": vision.intermediate_size,
    }


def mbridge_bridge(config, language_config):
    """mbridge's `Qwen2_5VLBridge` for the model being written, whose own `load_weights` fills it from the HF weights
    (its HF → megatron-core conversion and its own split across TP ranks) and whose own `export_weights` gives the HF
    weights back (what verl sends its rollout engine, and saves as the HF model, on its mbridge path).

    Set up as its `__init__` would be, without building mbridge's own (GPU) config: the HF config, the language
    model's TransformerConfig (what its `_build_config` gives, and what it consults for every `linear_fc1`), and the
    parallel state. Its key names are looked up under Transformer Engine's names for the local layers' norms."""
    from mbridge.core.parallel_states import ParallelStates
    from mbridge.models.qwen2_5_vl import Qwen2_5VLBridge

    class LocalLayersBridge(Qwen2_5VLBridge):
        def _weight_name_mapping_mcore_to_hf(self, mcore_weights_name: str) -> list[str]:
            return super()._weight_name_mapping_mcore_to_hf(te_key(mcore_weights_name))

        def _weight_to_hf_format(self, mcore_weights_name: str, mcore_weights):
            return super()._weight_to_hf_format(te_key(mcore_weights_name), mcore_weights)

    bridge = LocalLayersBridge.__new__(LocalLayersBridge)
    bridge.hf_config = _text_settings_on_top(config)
    bridge.config = language_config
    bridge.mpu = ParallelStates.get_parallel_state()
    bridge.extra_args = {}
    return bridge


def te_key(key: str) -> str:
    """A local layer's norm key under the name Transformer Engine's fused layer gives it, which mbridge maps."""
    for local, te in TE_NORM_KEYS.items():
        key = key.replace(local, te)
    return key


def _text_settings_on_top(config):
    """The config with its text settings also at the top level, where mbridge reads them (transformers 5 keeps
    them only under `text_config`)."""
    flat = copy.copy(config)
    for name, value in config.text_config.to_dict().items():
        if not hasattr(flat, name) or name in ("hidden_size", "num_attention_heads", "num_key_value_heads"):
            setattr(flat, name, value)
    return flat


def language_model_on_text(model, positions: torch.Tensor) -> tuple[torch.nn.Module, torch.Tensor]:
    """What runs the model on text alone: its language model, with the three M-RoPE position streams alike."""
    from mbridge.models.qwen2_5_vl.attention import Qwen2_5VLSelfAttention

    attend = Qwen2_5VLSelfAttention.forward
    if not hasattr(attend, "__wrapped__"):

        @functools.wraps(attend)
        def forward(self, *args, rotary_pos_cos_sin=None, **kwargs):  # passed by megatron-core newer than mbridge
            return attend(self, *args, **kwargs)

        Qwen2_5VLSelfAttention.forward = forward
    return model.language_model, positions[None].expand(3, *positions.shape)
