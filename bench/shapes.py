"""Real model shapes for the bench: Qwen2.5 configs, and their state-dict shapes from a meta-device model."""

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

QWEN25 = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2),
    "qwen2.5-3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                       num_key_value_heads=2),
}


def qwen25_config(model: str) -> Qwen2Config:
    config = Qwen2Config(vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, **QWEN25[model])
    config.architectures = ["Qwen2ForCausalLM"]
    return config


def state_dict_shapes(config: Qwen2Config) -> tuple[list[tuple[str, list[int]]], dict[str, str]]:
    """(name, shape) in state-dict order, and tied aliases (name -> the name it shares storage with)."""
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    first: dict[int, str] = {}
    shapes, tied = [], {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in first:
            tied[name] = first[id(tensor)]
        else:
            first[id(tensor)] = name
        shapes.append((name, list(tensor.shape)))
    return shapes, tied
