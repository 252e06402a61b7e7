"""Merge planning: from shard metadata and the model spec to the list of output tensors and files.

Pure functions over names, shapes and sizes: no I/O and no tensor data.
"""

import dataclasses
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from huggingface_hub import split_state_dict_into_shards_factory

from mergeflow import fp8
from mergeflow.dtypes import DTYPE_CHOICES, KEEP, dtype_name, output_dtype, parse_dtype_name
from mergeflow.errors import OptionError, PlanError, quoted
from mergeflow.formats.base import StoredTensor, TensorIndex
from mergeflow.lora import LoraFold, LoraPlan
from mergeflow.options import DEFAULT_DTYPE, MAX_SHARD_SIZE, check_dtype, check_quantize
from mergeflow.spec.model_spec import DECODER_LAYER, MTP_PREFIX, ModelSpec, SavedView, swapped
from mergeflow.spec.peft_names import ADAPTER_WEIGHTS_FILE
from mergeflow.spec.stacked_experts import with_stacked_halves

if TYPE_CHECKING:
    from peft import LoraConfig

SAFETENSORS_FILE_PATTERN = "model{suffix}.safetensors"
MAX_LISTED = 20


@dataclass(frozen=True)
class OutputTensor:
    """One tensor of the merged model: its name, the checkpoint tensor it comes from, and how it is stored."""

    name: str
    source: str
    shape: tuple[int, ...]
    dtype: str
    fold: LoraFold | None = None
    """A LoRA to fold into this weight as it is written."""
    view: SavedView | None = None
    """Where this tensor lies in the source, when it is a part of it (one expert of a fused tensor)."""
    quantized: bool = False
    """Written in FP8, block by block (`output.fp8`); its scales are the tensor whose `scale_of` it is."""
    scale_of: str | None = None
    """For a `weight_scale_inv` tensor: the quantized weight it scales (written right after it)."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * parse_dtype_name(self.dtype).itemsize


@dataclass(frozen=True)
class MergePlan:
    """Everything the writer needs: output tensors in write order and their assignment to files."""

    tensors: dict[str, OutputTensor]
    shard_to_names: dict[str, tuple[str, ...]]
    total_size: int
    config_dtype: str
    """The dtype written into config.json."""
    dropped_aliases: dict[str, str]
    """Tied aliases left out of the output (transformers re-ties them on load)."""
    unexpected: tuple[str, ...]
    """Tensors the config's model does not declare; written, and reported."""
    quantization: dict | None = None
    """config.json's `quantization_config` for an FP8 model (None otherwise)."""

    @property
    def name_to_shard(self) -> dict[str, str]:
        return {name: shard for shard, names in self.shard_to_names.items() for name in names}

    @property
    def is_sharded(self) -> bool:
        return len(self.shard_to_names) > 1


def plan_merge(
    index: TensorIndex,
    spec: ModelSpec,
    *,
    dtype: str = DEFAULT_DTYPE,
    max_shard_size: int | str = MAX_SHARD_SIZE,
    lora: LoraPlan | None = None,
    quantize: str | None = None,
    drop_mtp: bool = False,
) -> MergePlan:
    """Decide which tensors the merged model holds, in which dtype, and in which file.

    With `lora`, the base model's tensors are the ones it names (adapter wrappers removed), and
    its folds go with their weights. With `quantize="fp8"`, linear layers' weights are planned in FP8,
    each with its block scales (`output.fp8`), the other tensors in `dtype`. With `drop_mtp`, the layers
    after the decoder's (`mtp_layer_names`) are left out.

    Raises:
        OptionError: an unknown dtype or an unreadable max shard size.
        PlanError: the checkpoint lacks tensors the config needs, or their shapes disagree with it.
    """
    check_dtype(dtype)
    sources = (
        {name: index.tensors[source] for name, source in lora.base_sources.items()}
        if lora is not None
        else index.tensors
    )
    if drop_mtp:
        mtp = set(mtp_layer_names(sources, spec))
        sources = {name: source for name, source in sources.items() if name not in mtp}
    dropped = {name: spec.tied[name] for name in sources if name in spec.tied}
    kept = {name: source for name, source in sources.items() if name not in dropped}
    spec = with_stacked_halves(spec, kept)
    expected = expected_shapes(spec, kept)
    _check_against_config(kept, expected, spec, index.checkpoint_dir)
    folds = lora.folds if lora is not None else {}
    tensors = {
        name: OutputTensor(
            name=name,
            source=kept[kept_name].name,
            shape=shape,
            dtype=dtype_name(output_dtype(parse_dtype_name(kept[kept_name].dtype), dtype)),
            fold=folds.get(kept_name),
            view=view,
        )
        for name, (kept_name, shape, view) in _output_layout(spec, kept, folds).items()
    }
    config_dtype = _config_dtype(tensors.values()) if dtype == KEEP else dtype_name(DTYPE_CHOICES[dtype])
    quantization = None
    if quantize is not None:
        check_quantize(quantize)
        tensors, quantization = _quantized(tensors)
    split = _split_into_files(tensors, max_shard_size)
    return MergePlan(
        tensors=tensors,
        shard_to_names={filename: tuple(names) for filename, names in split.filename_to_tensors.items()},
        total_size=sum(tensor.nbytes for tensor in tensors.values()),
        config_dtype=config_dtype,
        dropped_aliases=dropped,
        unexpected=tuple(name for name in kept if name not in expected),
        quantization=quantization,
    )


def _quantized(tensors: dict[str, OutputTensor]) -> tuple[dict[str, OutputTensor], dict]:
    """The plan's linear weights in FP8, each followed by its scales; and the `quantization_config` that says
    so, listing the modules left unquantized (as transformers' `modules_to_not_convert` and vLLM's and
    SGLang's `ignored_layers` expect them)."""
    planned: dict[str, OutputTensor] = {}
    skipped = []
    for name, tensor in tensors.items():
        if not fp8.quantizable(name, tensor.shape):
            planned[name] = tensor
            if len(tensor.shape) == 2 and name.endswith(".weight"):
                skipped.append(name.removesuffix(".weight"))
            continue
        planned[name] = dataclasses.replace(tensor, dtype=dtype_name(fp8.FP8_DTYPE), quantized=True)
        scales = fp8.scale_name(name)
        planned[scales] = OutputTensor(scales, tensor.source, fp8.scale_shape(tensor.shape), "float32", scale_of=name)
    config = {**fp8.QUANTIZATION_CONFIG, "modules_to_not_convert": sorted(skipped), "ignored_layers": sorted(skipped)}
    return planned, config


@dataclass(frozen=True)
class AdapterPlan:
    """The LoRA adapter folder: its weights file, planned like a model's, and its PEFT config."""

    weights: MergePlan
    config: "LoraConfig"


def plan_adapter(index: TensorIndex, lora: LoraPlan, *, dtype: str = DEFAULT_DTYPE) -> AdapterPlan:
    """The adapter as PEFT saves it: PEFT's key names, one safetensors file, floating tensors in `dtype`."""
    check_dtype(dtype)
    tensors = {
        key: OutputTensor(
            name=key,
            source=source,
            shape=index.tensors[source].shape,
            dtype=dtype_name(output_dtype(parse_dtype_name(index.tensors[source].dtype), dtype)),
        )
        for key, source in sorted(lora.adapter_tensors.items())
    }
    weights = MergePlan(
        tensors=tensors,
        shard_to_names={ADAPTER_WEIGHTS_FILE: tuple(tensors)},
        total_size=sum(tensor.nbytes for tensor in tensors.values()),
        config_dtype=_config_dtype(tensors.values()) if dtype == KEEP else dtype_name(DTYPE_CHOICES[dtype]),
        dropped_aliases={},
        unexpected=(),
    )
    return AdapterPlan(weights=weights, config=lora.config)


def mtp_layer_names(names: Iterable[str], spec: ModelSpec) -> list[str]:
    """The multi-token-prediction layers' tensors: those under `mtp.` that the config does not declare (Qwen3-Next's,
    Qwen3.5's), and those of layers after the decoder's (DeepSeek-V3-style checkpoints keep them as
    `model.layers.{num_hidden_layers + k}`)."""
    declared = {*spec.expected_shapes, *spec.saved_shapes}
    layers = [int(match[1]) for name in declared if (match := DECODER_LAYER.match(name))]
    last = max(layers, default=None)
    return [
        name
        for name in names
        if (name.startswith(MTP_PREFIX) and name not in declared)
        or (last is not None and (match := DECODER_LAYER.match(name)) and int(match[1]) > last)
    ]


def expected_shapes(spec: ModelSpec, names: Iterable[str]) -> dict[str, tuple[int, ...]]:
    """The config's tensors under the naming the checkpoint uses: as in memory (FSDP state dicts) or as
    `save_pretrained` writes them (Megatron merges write per-expert MoE tensors)."""
    return spec.saved_shapes if _has_saved_names(spec, names) else spec.expected_shapes


def _has_saved_names(spec: ModelSpec, names: Iterable[str]) -> bool:
    names = set(names)
    return len(names & spec.saved_shapes.keys()) > len(names & spec.expected_shapes.keys())


def _output_layout(
    spec: ModelSpec, kept: dict[str, StoredTensor], folds: dict[str, LoraFold]
) -> dict[str, tuple[str, tuple[int, ...], SavedView | None]]:
    """Each output tensor's name, the kept tensor it comes from, its shape, and its view of it.

    A checkpoint in the in-memory naming of a model that saves under other names (transformers 5's
    fused MoE experts, saved one tensor per expert) is written as `save_pretrained` writes it: every
    saved tensor a view of the kept tensor it comes from. Tensors the config does not declare keep
    their names. A LoRA folded into a tensor that would be split keeps the in-memory names throughout.
    A tensor the model's checkpoints hold transposed (`ModelSpec.transposed_on_disk`), kept in the in-memory
    layout, is written transposed, as a view of the kept tensor.
    """
    as_kept = {name: _as_on_disk(spec, name, source.shape, folds) for name, source in kept.items()}
    if not spec.saved_views or _has_saved_names(spec, kept):
        return as_kept
    saved = {name: view for name, view in spec.saved_views.items() if view.source in kept}
    layout = {}
    for name, view in saved.items():
        shape, source_shape = spec.saved_shapes[name], kept[view.source].shape
        whole = shape == source_shape and view.offset == 0 and view.stride == _contiguous_strides(shape)
        if not whole and view.source in folds:
            return as_kept
        layout[name] = (view.source, shape, None if whole else view)
    split = {view.source for view in saved.values()}
    layout.update({name: entry for name, entry in as_kept.items() if name not in split})
    return layout


def _as_on_disk(
    spec: ModelSpec, name: str, shape: tuple[int, ...], folds: dict[str, LoraFold]
) -> tuple[str, tuple[int, ...], SavedView | None]:
    """A kept tensor's output: itself, or, where the model's checkpoints hold it transposed and it is kept in
    the in-memory layout (an FSDP checkpoint's), its transposed view."""
    on_disk = spec.shape_on_disk(name, shape)
    if name in folds or on_disk == shape or shape != spec.expected_shapes.get(name):
        return name, shape, None
    return name, on_disk, SavedView(name, swapped(_contiguous_strides(shape), spec.transposed_on_disk[name]), 0)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _check_against_config(
    kept: dict[str, StoredTensor], expected: dict[str, tuple[int, ...]], spec: ModelSpec, checkpoint_dir: str
) -> None:
    config_path = f"{spec.config_dir}/config.json"
    missing = [name for name in expected if name not in kept]
    if missing:
        raise PlanError(
            f"checkpoint {checkpoint_dir} lacks tensor(s) that {spec.model_class} from {config_path} needs: "
            f"{_listed(missing)}"
        )
    mismatches = [
        f"{name}: got {source.shape}, expected {expected[name]}"
        for name, source in kept.items()
        if name in expected and source.shape not in (expected[name], spec.shape_on_disk(name, expected[name]))
    ]
    if mismatches:
        raise PlanError(
            f"shape mismatch between checkpoint {checkpoint_dir} and {config_path} "
            f"({len(mismatches)} tensor(s)): " + "; ".join(mismatches[:MAX_LISTED])
        )


def _listed(names: list[str]) -> str:
    more = f" and {len(names) - MAX_LISTED} more" if len(names) > MAX_LISTED else ""
    return quoted(names[:MAX_LISTED]) + more


def _split_into_files(tensors: dict[str, OutputTensor], max_shard_size: int | str):
    """huggingface_hub's sharding; a weight's scales are kept in its file (they are written right after it)."""
    try:
        return split_state_dict_into_shards_factory(
            tensors,
            get_storage_size=lambda tensor: tensor.nbytes,
            get_storage_id=lambda tensor: tensor.scale_of,
            filename_pattern=SAFETENSORS_FILE_PATTERN,
            max_shard_size=max_shard_size,
        )
    except ValueError as e:
        raise OptionError(f"invalid max shard size {max_shard_size!r}: {e}") from e


def _config_dtype(tensors) -> str:
    """For `--dtype keep`: the floating dtype holding the most bytes."""
    by_dtype = Counter()
    for tensor in tensors:
        if parse_dtype_name(tensor.dtype).is_floating_point:
            by_dtype[tensor.dtype] += tensor.nbytes
    return by_dtype.most_common(1)[0][0] if by_dtype else "float32"
