"""The options of a merge: their choices and defaults, each defined once (imports no torch)."""

from dataclasses import dataclass

from mergeflow.errors import OptionError

DTYPE_NAMES = ("bf16", "fp16", "fp32", "keep")
"""`--dtype` choices: the floating dtype written, or `keep` for the shards' own."""
DEFAULT_DTYPE = "bf16"
"""verl's merger writes bf16."""
MAX_SHARD_SIZE = "5GB"
QUANTIZE_CHOICES = ("fp8",)
"""`--quantize` choices: FP8 weights with 128×128 block scales (`output.fp8`)."""
DEFAULT_TARGET_DIR = "tmp"
"""verl's merger writes to ./tmp when no --target_dir is given."""


@dataclass(frozen=True)
class MergeOptions:
    """Every option that changes what a merge writes (and so enters its cache key)."""

    backend: str = "fsdp"
    dtype: str = DEFAULT_DTYPE
    max_shard_size: str = MAX_SHARD_SIZE
    hf_model_config_path: str | None = None
    trust_remote_code: bool = False
    is_value_model: bool = False
    tie_word_embedding: bool = False
    merge_lora: bool = False
    lora_alpha: float | None = None
    base_model: str | None = None
    quantize: str | None = None
    drop_mtp: bool = False
    """Leave out multi-token-prediction layers (kept by default, for speculative decoding)."""


def check_quantize(quantize: str) -> None:
    if quantize not in QUANTIZE_CHOICES:
        raise OptionError(f"unknown quantization '{quantize}': choose one of {', '.join(QUANTIZE_CHOICES)}")


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPE_NAMES:
        raise OptionError(f"unknown dtype '{dtype}': choose one of {', '.join(DTYPE_NAMES)}")


def check_shard_size(max_shard_size: str | int) -> None:
    """Raises OptionError unless huggingface_hub reads `max_shard_size` as a size ("5GB", "500MB", bytes)."""
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        parse_size_to_int(max_shard_size)
    except ValueError as e:
        raise OptionError(f"invalid --max-shard-size {max_shard_size!r}: {e}") from e


def is_hub_model_id(name: object) -> bool:
    """Whether `name` reads as a Hub model id (`org/name`) rather than a local path."""
    if not isinstance(name, str) or name.startswith(("/", ".", "~")):
        return False
    try:
        check_repo_id(name)
    except OptionError:
        return False
    return True


def check_repo_id(repo_id: str) -> None:
    """Raises OptionError unless `repo_id` reads `user/name` as the Hub accepts it."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise OptionError(f"invalid --hf_upload_path {repo_id!r}: {e}") from e
    if repo_id.count("/") != 1:
        raise OptionError(f"invalid --hf_upload_path {repo_id!r}: expected 'user/name' or 'org/name'")
