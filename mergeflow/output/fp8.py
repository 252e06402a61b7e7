"""Block-wise FP8 weights, as DeepSeek-V3's and Qwen3's FP8 checkpoints store them (and vLLM, SGLang and
transformers load them): `float8_e4m3fn` values, and a float32 `weight_scale_inv` per 128×128 block by
which they multiply back. Which weights are quantized is decided by name (`quantizable`)."""

import math
import re

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


def quantize(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 values and the per-block scales of a block of rows (whole 128-row blocks but for the last).

    Returns:
        The rows in `float8_e4m3fn`, and float32 scales of shape `scale_shape(rows.shape)`: each block's
        largest magnitude over LARGEST_CODE (1 for a block of zeros).
    """
    rows = rows.float()
    blocks = _blocked(rows)
    largest = blocks.abs().amax(dim=(1, 3))
    scales = torch.where(largest > 0, largest / LARGEST_CODE, torch.ones_like(largest))
    values = (blocks / scales[:, None, :, None]).to(FP8_DTYPE)
    return _unblocked(values, rows.shape), scales


def dequantize(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Float32 weights from FP8 values and their block scales."""
    blocks = _blocked(values.float()) * scales[:, None, :, None]
    return _unblocked(blocks, values.shape)


def rounding_error(reference: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> tuple[float, int]:
    """How far dequantized values are from the rows they were quantized from (whole 128-row blocks but the last).

    Returns:
        The largest relative error among elements in e4m3's normal range (at most 2^-4 when correct), and
        how many elements are outside the rounding bound: half e4m3's step at their magnitude (2^-4
        relative for normal values; for the smallest, half the subnormal step, 2^-10 of the block's scale).
    """
    reference = reference.float()
    error = (dequantize(values, scales) - reference).abs()
    block_scales = _unblocked(
        scales[:, None, :, None].expand(-1, BLOCK, -1, BLOCK).contiguous(), (scales.shape[0] * BLOCK, scales.shape[1] * BLOCK)
    )[: reference.shape[0], : reference.shape[1]]
    outside = int((error > torch.maximum(reference.abs() / 16, block_scales / 1024)).sum())
    normal = reference.abs() >= block_scales / 64
    relative = (error[normal] / reference.abs()[normal]).max() if normal.any() else torch.tensor(0.0)
    return float(relative), outside


def _blocked(matrix: torch.Tensor) -> torch.Tensor:
    """(r, c) -> (r/B, B, c/B, B), zero-padded to whole blocks."""
    rows, columns = matrix.shape
    padded = torch.nn.functional.pad(matrix, (0, -columns % BLOCK, 0, -rows % BLOCK))
    return padded.view(padded.shape[0] // BLOCK, BLOCK, padded.shape[1] // BLOCK, BLOCK)


def _unblocked(blocks: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    rows, columns = shape
    return blocks.reshape(blocks.shape[0] * BLOCK, blocks.shape[2] * BLOCK)[:rows, :columns].contiguous()
