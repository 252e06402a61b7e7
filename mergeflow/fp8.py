"""Block-wise FP8 weights, as DeepSeek-V3's and Qwen3's FP8 checkpoints store them (and vLLM, SGLang and
transformers load them): `float8_e4m3fn` values, and a float32 `weight_scale_inv` per 128×128 block by
which they multiply back. Which weights are quantized is decided by name (`quantizable`)."""

import math
import re
from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
BLOCK = 128
"""Rows and columns of one block; partial blocks at the edges have scales of their own."""
LARGEST_CODE = 256.0
"""What a block's largest magnitude is scaled to: a power of two (e4m3 reaches 448), so that dividing by the
scale and multiplying back are exact, and dequantizing gives each block's largest value back bit for bit."""
SCALE_SUFFIX = "_scale_inv"
QUANTIZATION_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [BLOCK, BLOCK]}
"""`quantization_config` of config.json (its skip lists are added per model)."""
KEPT_IN_BF16 = re.compile(
    r"(^|\.)(embed_tokens|embed_positions|word_embeddings|wte|wpe|lm_head|score)\.weight$"
    r"|(^|\.)(gate|router|shared_expert_gate)\.weight$"
    r"|(^|\.)(visual|vision_tower|vision_model|multi_modal_projector|mm_projector)\."
)
"""Weights left unquantized: embeddings, the output head, routers and MoE gates, and a VLM's vision tower."""
FP8_DESCRIPTION = (
    f"float8_e4m3fn with a float32 weight_scale_inv per {BLOCK}x{BLOCK} block (each block's largest magnitude "
    f"/ {LARGEST_CODE:g}), quantized by mergeflow as it merged, from the trained weights in float32; embeddings, "
    "the output head, routers and vision towers kept in the model's dtype"
)
"""How an FP8 model was made, for its model card."""


def quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Whether an output tensor is a linear layer's weight to store in FP8: 2-D, not one `KEPT_IN_BF16`, and
    each side a whole number of blocks or within one block. (A weight with a partial block beside whole ones
    is kept in the model's dtype: transformers' CPU dequantizer takes the block size to be the side over the
    number of scales, which only these shapes satisfy.)"""
    return (
        len(shape) == 2
        and name.endswith(".weight")
        and not KEPT_IN_BF16.search(name)
        and all(size % BLOCK == 0 or size < BLOCK for size in shape)
    )


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """One scale per 128×128 block, partial blocks at the edges included."""
    return math.ceil(shape[0] / BLOCK), math.ceil(shape[1] / BLOCK)


@dataclass(frozen=True)
class Quantized:
    """A block of rows in FP8, and how far it rounded."""

    values: torch.Tensor
    """The rows in `float8_e4m3fn`."""
    scales: torch.Tensor
    """float32, of shape `scale_shape(values.shape)`: each block's largest magnitude over LARGEST_CODE (1 for a
    block of zeros)."""
    largest_relative_error: float
    """Each element's rounding error relative to its magnitude (or to e4m3's smallest normal, for the
    smallest): at most 2^-4, half a step, when quantization is right."""
    outside: int
    """Elements further than half a step from their source."""


def quantize(rows: torch.Tensor) -> Quantized:
    """Quantize a block of rows (whole 128-row blocks but for the last), checking each value's rounding as it
    goes: on the scaled values, where the bound is the same for every block."""
    blocks = _blocked(rows.float())
    largest = blocks.abs().amax(dim=(1, 3))
    scales = torch.where(largest > 0, largest / LARGEST_CODE, torch.ones_like(largest))
    scaled = blocks.div_(scales[:, None, :, None])
    values = scaled.to(FP8_DTYPE)
    relative, outside = _rounding(scaled, values.float(), torch.tensor(1.0))
    return Quantized(_unblocked(values, rows.shape), scales, relative, outside)


def dequantize(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Float32 weights from FP8 values and their block scales."""
    blocks = _blocked(values.float()) * scales[:, None, :, None]
    return _unblocked(blocks, values.shape)


def rounding_error(reference: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> tuple[float, int]:
    """How far dequantized values are from the rows they were quantized from (whole 128-row blocks but the last):
    the largest relative error and the elements outside the rounding bound, as `Quantized` has them."""
    block_scales = scales[:, None, :, None]
    return _rounding(_blocked(reference.float()), _blocked(values.float()).mul_(block_scales), block_scales)


def _rounding(source: torch.Tensor, rounded: torch.Tensor, scale: torch.Tensor) -> tuple[float, int]:
    """`source` and `rounded` blocked, `scale` the blocks' scales (broadcast). Each element's error is taken
    relative to its magnitude, or to e4m3's smallest normal (2^-6 of the scale) below it, so that one ratio
    holds both bounds: 2^-4 (half a step) for normal values, 2^-10 of the scale for subnormal ones."""
    ratio = rounded.sub_(source).abs_().div_(torch.maximum(source.abs(), scale / 64))
    return float(ratio.amax()) if ratio.numel() else 0.0, int((ratio > 2**-4).sum())


def _blocked(matrix: torch.Tensor) -> torch.Tensor:
    """(r, c) -> (r/B, B, c/B, B), zero-padded to whole blocks."""
    rows, columns = matrix.shape
    padded = torch.nn.functional.pad(matrix, (0, -columns % BLOCK, 0, -rows % BLOCK))
    return padded.view(padded.shape[0] // BLOCK, BLOCK, padded.shape[1] // BLOCK, BLOCK)


def _unblocked(blocks: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    rows, columns = shape
    return blocks.reshape(blocks.shape[0] * BLOCK, blocks.shape[2] * BLOCK)[:rows, :columns].contiguous()
