"""Dtype names: the CLI's spellings, torch dtypes and safetensors' codes."""

import torch

from mergeflow.options import DTYPE_NAMES

KEEP = "keep"

DTYPE_CHOICES: dict[str, torch.dtype | None] = dict(
    zip(DTYPE_NAMES, (torch.bfloat16, torch.float16, torch.float32, None), strict=True)
)
"""The torch dtype of each `--dtype` choice (None: keep the shards' own)."""

SAFETENSORS_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}

TORCH_NAMES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype for dtype in SAFETENSORS_CODES
}


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"`, the spelling config.json and manifests use."""
    return str(dtype).removeprefix("torch.")


def parse_dtype_name(name: str) -> torch.dtype:
    """Inverse of `dtype_name`."""
    return TORCH_NAMES[name]


def output_dtype(source: torch.dtype, choice: str) -> torch.dtype:
    """The dtype a source tensor is written in: floating tensors take the chosen dtype, others keep theirs."""
    target = DTYPE_CHOICES[choice]
    if target is None or not source.is_floating_point:
        return source
    return target
