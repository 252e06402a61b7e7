"""The options of a merge and of its upload, as the objects the flows, deployments and sweep take; their
choices and defaults, each defined once (imports no torch)."""

import dataclasses
import os
from dataclasses import dataclass

from mergeflow.errors import OptionError

DEFAULT_BACKEND = "fsdp"
"""`--backend` when none is given, as in verl's merger (a backend of `formats.registry`)."""
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

    backend: str = DEFAULT_BACKEND
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

    @classmethod
    def from_values(cls, values: object) -> "MergeOptions":
        """The options `values` (an argparse namespace, say) has attributes for; a None keeps the default."""
        return cls(**given_fields(cls, values))

    def with_absolute_paths(self) -> "MergeOptions":
        """These options with the config path made absolute (a worker on another node has another working directory)."""
        if self.hf_model_config_path is None:
            return self
        return dataclasses.replace(self, hf_model_config_path=os.path.abspath(self.hf_model_config_path))


DEFAULT_OPTIONS = MergeOptions()
"""A merge's options when none is given (the flows' default)."""


def given_fields(cls: type, values: object, renamed: dict[str, str] | None = None) -> dict[str, object]:
    """The fields of dataclass `cls` that `values` (an argparse namespace) gives other than None, each read from the
    attribute of its own name or of the name `renamed` maps it to."""
    renamed = renamed or {}
    given = {field.name: getattr(values, renamed.get(field.name, field.name), None) for field in dataclasses.fields(cls)}
    return {name: value for name, value in given.items() if value is not None}


@dataclass(frozen=True)
class Reference:
    """A reference model to compare a merged model with (`--test_hf_dir`), and how closely."""

    test_hf_dir: str
    check_logits: bool = False
    """Also compare the two models' logits (on CPU, when both fit in memory)."""
    atol: float = 0.0
    rtol: float = 0.0

    @classmethod
    def from_values(cls, values: object) -> "Reference | None":
        """The reference an argparse namespace names, None without one."""
        fields = given_fields(cls, values)
        return cls(**fields) if fields.get("test_hf_dir") else None


UPLOAD_RETRIES = 6
UPLOAD_RETRY_DELAY_SECONDS = 10.0
"""First delay between attempts; each retry doubles it (10, 20, 40, ... 320 s: ten minutes in all), with jitter."""


@dataclass(frozen=True)
class HubUpload:
    """Where and how a merged model is uploaded to the Hugging Face Hub."""

    repo_id: str
    private: bool = False
    revision: str | None = None
    """The branch; None: a branch per training step, `step-N`."""
    token_secret: str | None = None
    """A Prefect Secret block holding the token; None: HF_TOKEN or the huggingface_hub login."""
    retries: int = UPLOAD_RETRIES
    retry_delay_seconds: float = UPLOAD_RETRY_DELAY_SECONDS

    @classmethod
    def from_values(cls, values: object) -> "HubUpload | None":
        """The upload an argparse namespace asks for (`hf_upload_path`, `private`, `revision`, `hf_token_secret`),
        None without a repo."""
        fields = given_fields(cls, values, {"repo_id": "hf_upload_path", "token_secret": "hf_token_secret"})
        return cls(**fields) if fields.get("repo_id") else None


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
