"""The Hugging Face side of a checkpoint: config, model class, expected tensors, and files to carry over."""

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode

from mergeflow.errors import CheckpointError
from mergeflow.spec import cache as spec_cache
from mergeflow.spec.config_files import CONFIG_FILE, require_config
from mergeflow.spec.config_values import config_values

if TYPE_CHECKING:
    from transformers import PretrainedConfig

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
WEIGHT_INDEX_SUFFIX = ".index.json"

AUTO_CLASS_BY_SUFFIX = {
    "ForTokenClassification": "AutoModelForTokenClassification",
    "ForCausalLM": "AutoModelForCausalLM",
    "ForConditionalGeneration": "AutoModelForImageTextToText",
    "ForSequenceClassification": "AutoModelForSequenceClassification",
}
VALUE_MODEL_SUFFIX = "ForTokenClassification"
DECODER_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
MTP_PREFIX = "mtp."
"""Where Qwen3-Next's and Qwen3.5's checkpoints keep their multi-token-prediction layer."""
"""A tensor of decoder layer N, as causal LMs name them (its index is group 1)."""
SPEC_FIELDS = (
    "architecture",
    "model_class",
    "expected_shapes",
    "saved_shapes",
    "saved_views",
    "transposed_on_disk",
    "tied",
    "is_value_model",
    "derived_generation_config",
    "config_values",
)
"""The fields `_spec_fields` derives and the spec cache stores."""


@dataclass(frozen=True)
class SavedView:
    """A tensor as `save_pretrained` writes it, as a strided view of one in-memory tensor: one expert's
    `gate_proj` is rows of the fused `experts.gate_up_proj`. A plain rename has the source's own layout."""

    source: str
    stride: tuple[int, ...]
    offset: int
    """Elements from the start of the (contiguous) source."""


@dataclass(frozen=True)
class ModelSpec:
    """What the Hugging Face config says the merged model must hold."""

    config_dir: str
    """Directory with config.json, the tokenizer and the other files copied into the output."""
    architecture: str
    model_class: str
    """A transformers class name (`Qwen2ForCausalLM`) or an auto class for remote code."""
    trust_remote_code: bool
    expected_shapes: dict[str, tuple[int, ...]]
    """Every tensor the model's state dict holds, tied aliases excluded."""
    saved_shapes: dict[str, tuple[int, ...]]
    """The same tensors under the names `save_pretrained` writes, where transformers converts them on load
    (MoE experts are one fused tensor in memory but one tensor per expert on disk)."""
    saved_views: dict[str, SavedView]
    """Where each saved tensor lies in the in-memory tensors, for a model whose saved names differ
    (empty when they are the same)."""
    tied: dict[str, str]
    """Tied aliases (not written) mapped to the tensor they share, e.g. lm_head.weight -> embed_tokens."""
    is_value_model: bool
    derived_generation_config: str | None = None
    """generation_config.json as transformers derives it from the model config, for checkpoints without one
    (None for a model that does not generate)."""
    config_values: dict[str, Any] = field(default_factory=dict)
    """The config's values as plain data (`spec.config_values`), for readers that need more of it than the tensors."""
    transposed_on_disk: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Tensors the model's own checkpoints hold with two axes swapped from its in-memory layout, and those axes:
    transformers transposes them on load when they come so (Qwen3-VL-MoE's experts, input-major on disk, as vLLM
    reads them)."""

    def shape_on_disk(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """`shape` (in memory) as the model's checkpoints hold the tensor."""
        return swapped(shape, self.transposed_on_disk[name]) if name in self.transposed_on_disk else shape


def swapped(values: tuple[int, ...], axes: tuple[int, int]) -> tuple[int, ...]:
    """A shape's (or strides') values with the two axes exchanged."""
    first, second = axes
    exchanged = list(values)
    exchanged[first], exchanged[second] = values[second], values[first]
    return tuple(exchanged)


def load_model_spec(
    config_dir: Path,
    *,
    trust_remote_code: bool = False,
    is_value_model: bool = False,
    tie_word_embedding: bool = False,
) -> ModelSpec:
    """Read config.json and build the model on the meta device to learn its tensors and ties.

    The result is remembered (`mergeflow.spec.cache`): the next checkpoint with the same config is
    planned without importing transformers.

    Raises:
        CheckpointError: config.json is missing or unreadable, or the architecture is unknown.
    """
    config_dir = Path(config_dir)
    require_config(config_dir)
    fields = spec_cache.cached_fields(
        spec_cache.model_spec_key(config_dir, trust_remote_code=trust_remote_code, is_value_model=is_value_model),
        lambda: _spec_fields(config_dir, trust_remote_code=trust_remote_code, is_value_model=is_value_model),
        required=SPEC_FIELDS,
    )
    spec = ModelSpec(
        config_dir=str(config_dir),
        architecture=fields["architecture"],
        model_class=fields["model_class"],
        trust_remote_code=trust_remote_code,
        expected_shapes={name: tuple(shape) for name, shape in fields["expected_shapes"].items()},
        saved_shapes={name: tuple(shape) for name, shape in fields["saved_shapes"].items()},
        saved_views={
            name: SavedView(source, tuple(stride), offset) for name, (source, stride, offset) in fields["saved_views"].items()
        },
        transposed_on_disk={name: tuple(axes) for name, axes in fields["transposed_on_disk"].items()},
        tied=fields["tied"],
        is_value_model=fields["is_value_model"],
        derived_generation_config=fields["derived_generation_config"],
        config_values=fields["config_values"],
    )
    if tie_word_embedding and not spec.tied:
        raise CheckpointError(
            f"--tie-word-embedding contradicts {config_dir / CONFIG_FILE}, which does not tie the word embeddings; "
            "drop the flag (the config decides, so that lm_head is never dropped by mistake)"
        )
    return spec


def store_model_spec(config_dir: Path, *, trust_remote_code: bool = False, is_value_model: bool = False) -> None:
    """Build the spec and store it in the cache, for a builder that holds the entry's build lock already
    (`mergeflow.spec.build`'s child)."""
    key = spec_cache.model_spec_key(config_dir, trust_remote_code=trust_remote_code, is_value_model=is_value_model)
    spec_cache.store(key, _spec_fields(config_dir, trust_remote_code=trust_remote_code, is_value_model=is_value_model))


def _spec_fields(config_dir: Path, *, trust_remote_code: bool, is_value_model: bool) -> dict[str, Any]:
    """The spec's fields, as JSON values, from the model built on the meta device."""
    config = load_config(config_dir, trust_remote_code=trust_remote_code)
    architecture = _architecture(config, config_dir, is_value_model)
    model_class = _model_class_name(architecture, config, config_dir)
    if is_value_model:
        _make_value_config(config, architecture)
    model = _meta_model(model_class, config, trust_remote_code, config_dir)
    tied = _tied_aliases(model)
    state = {name: tensor for name, tensor in model.state_dict().items() if name not in tied}
    expected = {name: list(tensor.shape) for name, tensor in state.items()}
    saved_shapes = _saved_shapes(model, state)
    return {
        "architecture": architecture,
        "model_class": model_class,
        "expected_shapes": expected,
        "saved_shapes": saved_shapes or expected,
        "saved_views": _saved_views(model, state, saved_shapes) if saved_shapes else {},
        "transposed_on_disk": _transposed_on_disk(model, state),
        "tied": tied,
        "is_value_model": architecture.endswith(VALUE_MODEL_SUFFIX),
        "derived_generation_config": _derived_generation_config(config) if model.can_generate() else None,
        "config_values": config_values(config),
    }


def _derived_generation_config(config: "PretrainedConfig") -> str:
    """The generation_config.json `save_pretrained` writes for a model whose checkpoint has none."""
    from transformers import GenerationConfig

    return GenerationConfig.from_model_config(config).to_json_string(use_diff=True)


def load_config(config_dir: Path, *, trust_remote_code: bool = False) -> "PretrainedConfig":
    path = require_config(config_dir)
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(config_dir, trust_remote_code=trust_remote_code)
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise CheckpointError(
                f"{path} needs custom code: pass --trust-remote-code to allow running it"
            ) from e
        raise CheckpointError(f"cannot read {path}: {e}") from e
    except (OSError, json.JSONDecodeError, KeyError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e


def _architecture(config: "PretrainedConfig", config_dir: Path, is_value_model: bool) -> str:
    architectures = getattr(config, "architectures", None) or []
    if not architectures:
        raise CheckpointError(
            f"{config_dir / CONFIG_FILE} names no 'architectures': cannot tell which model to build"
        )
    architecture = architectures[0]
    if is_value_model and not architecture.endswith(VALUE_MODEL_SUFFIX):
        base = next(
            (architecture.removesuffix(s) for s in AUTO_CLASS_BY_SUFFIX if architecture.endswith(s)),
            architecture,
        )
        architecture = base + VALUE_MODEL_SUFFIX
    return architecture


def _model_class_name(architecture: str, config: "PretrainedConfig", config_dir: Path) -> str:
    import transformers

    if hasattr(transformers, architecture):
        return architecture
    for suffix, auto_class in AUTO_CLASS_BY_SUFFIX.items():
        if architecture.endswith(suffix) and getattr(config, "auto_map", None):
            return auto_class
    raise CheckpointError(
        f'unknown architecture "{architecture}" in {config_dir / CONFIG_FILE}: transformers '
        f"{transformers.__version__} has no such class and the config has no auto_map for remote code"
    )


def _make_value_config(config: "PretrainedConfig", architecture: str) -> None:
    config.architectures = [architecture]
    config.num_labels = 1


def build_meta_model(spec: ModelSpec) -> torch.nn.Module:
    """The spec's model on the meta device (shapes and module structure, no memory)."""
    config_dir = Path(spec.config_dir)
    config = load_config(config_dir, trust_remote_code=spec.trust_remote_code)
    if config.architectures != [spec.architecture]:
        _make_value_config(config, spec.architecture)
    return _meta_model(spec.model_class, config, spec.trust_remote_code, config_dir)


def _meta_model(model_class: str, config: "PretrainedConfig", trust_remote_code: bool, config_dir: Path):
    import transformers

    cls = getattr(transformers, model_class)
    try:
        with torch.device("meta"):
            if model_class.startswith("Auto"):
                return cls.from_config(config, trust_remote_code=trust_remote_code)
            return cls(config)
    except Exception as e:
        raise CheckpointError(f"cannot build {model_class} from {config_dir / CONFIG_FILE}: {e}") from e


def _saved_shapes(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    """The shapes of the state dict as `save_pretrained` writes it, by transformers' own reverse conversion
    (`revert_weight_conversion`; empty where there is none to apply: transformers 4, or a remote-code model
    it cannot convert)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion

        saved = revert_weight_conversion(model, dict(state))
    except Exception:
        return {}
    return {name: list(tensor.shape) for name, tensor in saved.items()}


def _transposed_on_disk(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    """The tensors that transformers' own conversion transposes on load when their shape is not the model's
    (`Transpose(check_dims=True)`), with its two axes (empty without such a conversion)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import Transpose, WeightConverter

        conversions = get_model_conversion_mapping(model)
    except Exception:
        return {}
    transposes = [
        (pattern, conversion.operations[0])
        for conversion in conversions
        if isinstance(conversion, WeightConverter) and len(conversion.operations) == 1
        if isinstance(conversion.operations[0], Transpose) and conversion.operations[0].check_dims
        for pattern in conversion.target_patterns
    ]
    return {
        name: [transpose.dim0, transpose.dim1]
        for name in state
        for pattern, transpose in transposes
        if re.search(pattern, name)
    }


def _saved_views(
    model: torch.nn.Module, state: dict[str, torch.Tensor], saved_shapes: dict[str, list[int]]
) -> dict[str, list]:
    """Where each tensor `save_pretrained` writes lies in the in-memory ones, as [source, stride, offset].

    The reverse conversion is run again on fresh meta tensors with `contiguous()` made a no-op, so what it
    returns is a view of the in-memory tensor it comes from: its strides and offset say where it lies.
    Empty when the names are the same as in memory, when the conversion fails this way, or when a saved
    tensor is not a view of one in-memory tensor (a conversion that computes or concatenates).
    """
    probes = {name: torch.empty(tensor.shape, dtype=tensor.dtype, device="meta") for name, tensor in state.items()}
    try:
        from transformers.core_model_loading import revert_weight_conversion

        with _ContiguousAsIs():
            saved = revert_weight_conversion(model, dict(probes))
    except Exception:
        return {}
    if {name: list(tensor.shape) for name, tensor in saved.items()} != saved_shapes:
        return {}
    source_of = {id(probe): name for name, probe in probes.items()}
    views = {}
    for name, tensor in saved.items():
        base = tensor if id(tensor) in source_of else tensor._base
        if base is None or id(base) not in source_of:
            return {}
        views[name] = [source_of[id(base)], list(tensor.stride()), tensor.storage_offset()]
    unchanged = all(saved[name] is probes.get(name) for name in saved)
    return {} if unchanged else views


class _ContiguousAsIs(TorchFunctionMode):
    """`Tensor.contiguous()` returns the tensor itself, so a conversion's result stays a view of its input."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.contiguous:
            return args[0]
        return func(*args, **(kwargs or {}))


def _tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """State-dict names that are the same parameter as an earlier name, as transformers ties them."""
    first_name: dict[int, str] = {}
    tied = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in first_name:
            tied[name] = first_name[id(tensor)]
        else:
            first_name[id(tensor)] = name
    return tied
