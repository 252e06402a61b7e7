"""How PEFT names a LoRA adapter's tensors and files, and where verl keeps them (names only: imports no torch)."""

import re

PEFT_PREFIX = "base_model.model."
LORA_META_FILE = "lora_train_meta.json"
"""verl's record of the LoRA rank, alpha and task type, beside the rank files."""
ADAPTER_SUBDIR = "lora_adapter"
"""Where an adapter lives: in the checkpoint (older verl saved its config there) and in the output."""
ADAPTER_CONFIG_FILE = "adapter_config.json"
SOURCE_ADAPTER_DIRS = (ADAPTER_SUBDIR, "model/huggingface/adapter")
"""Where a checkpoint may hold its adapter's config: `lora_adapter/` (verl's FSDP checkpoints, in older
releases), and the PEFT folder verl exports for a Megatron run with Megatron-Bridge."""
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
LORA_KEY = re.compile(
    r"^(?P<module>.+)\.(?P<part>lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)"
    r"\.(?P<adapter>[^.]+)(?:\.(?P<param>weight|bias))?$"
)
TRAINED_COPY_KEY = re.compile(r"^(?P<module>.+)\.modules_to_save\.(?P<adapter>[^.]+)\.(?P<param>.+)$")
"""A module PEFT trains in full (`modules_to_save`): this copy holds the trained values."""
ORIGINAL_COPY_MARKER = ".original_module."
"""The untouched base of a `modules_to_save` module."""
LORA_ONLY_MARKERS = ("lora_", ".adapter_")
"""verl's `save_lora_only` keeps exactly the tensors whose names hold one of these."""



def lora_tensor_names(names) -> list[str]:
    return [name for name in names if any(marker in name for marker in LORA_ONLY_MARKERS)]
