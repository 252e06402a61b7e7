"""LoRA in verl checkpoints: find the adapter's tensors, rebuild its PEFT config, and plan the adapter
file and the base model (plain, or with the LoRA folded in).

verl trains LoRA as a PEFT model wrapped by FSDP, so the checkpoint's names are PEFT's:
`base_model.model.<hf name>`, `.base_layer.` inside adapted modules, `<module>.lora_A.<adapter>.weight`,
and `.modules_to_save.<adapter>.` / `.original_module.` for fully trained modules. The config is
inferred from those names and shapes, then checked by building the PEFT model on the meta device:
it must hold exactly the checkpoint's tensors. Scalings, module kinds and adapter-file names are
read off that PEFT model, so they follow PEFT's own rules (rank and alpha patterns, rsLoRA, DoRA).
peft is imported only for checkpoints that hold LoRA tensors (it costs a second and a half).
"""

import copy
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mergeflow.errors import CheckpointError, OptionError, PlanError, quoted
from mergeflow.formats.base import TensorIndex
from mergeflow.spec.model_spec import ModelSpec, build_meta_model
from mergeflow.spec.peft_names import (
    ADAPTER_CONFIG_FILE,
    LORA_KEY,
    LORA_META_FILE,
    ORIGINAL_COPY_MARKER,
    PEFT_PREFIX,
    SOURCE_ADAPTER_DIRS,
    TRAINED_COPY_KEY,
    lora_tensor_names,
)

if TYPE_CHECKING:
    from peft import LoraConfig

@dataclass(frozen=True)
class LoraFold:
    """How to fold one module's LoRA into its base weight: `W += scaling · B·A` (`(B·A)ᵀ` when
    `transposed`, as for embeddings), then, for DoRA, scale each row to its magnitude."""

    lora_a: str
    lora_b: str
    scaling: float
    transposed: bool
    magnitude: str | None = None
    """DoRA's magnitude vector (one value per output row)."""


@dataclass(frozen=True)
class LoraPlan:
    """A LoRA checkpoint resolved against its base model: names only, no tensors."""

    config: "LoraConfig"
    """The adapter's PEFT config, as PEFT would save it."""
    adapter_name: str
    adapter_tensors: dict[str, str]
    """Adapter-file key (PEFT's saved name) -> checkpoint tensor."""
    base_sources: dict[str, str]
    """Hugging Face name of each base-model tensor -> checkpoint tensor (empty for LoRA-only checkpoints)."""
    folds: dict[str, LoraFold]
    """Base weights that get a LoRA folded in (only with `merge`)."""
    merge: bool
    lora_only: bool
    alpha_source: str
    """Where lora_alpha came from, for the report."""
    notes: tuple[str, ...] = ()


def describe_lora(lora: LoraPlan) -> str:
    """One line for reports: kind, rank, alpha and where it came from, targets, and what was written."""
    config = lora.config
    kind = "DoRA" if config.use_dora else "LoRA"
    where = (
        f"folded into {len(lora.folds)} weight(s)"
        if lora.merge
        else "adapter in lora_adapter/" + (" (LoRA-only checkpoint: no base model)" if lora.lora_only else "")
    )
    return (
        f"{kind} r={config.r}, alpha={config.lora_alpha} (from {lora.alpha_source}), "
        f"targets {', '.join(sorted(config.target_modules))}; {where}"
    )


def plan_lora(
    index: TensorIndex, spec: ModelSpec, *, merge: bool = False, lora_alpha: float | None = None
) -> LoraPlan | None:
    """Resolve a checkpoint's LoRA tensors, or return None when it has none.

    Raises:
        OptionError: `merge` or `lora_alpha` given for a checkpoint without LoRA, or an alpha that
            contradicts the checkpoint's own record.
        CheckpointError: no lora_alpha anywhere, or an unreadable LoRA metadata file.
        PlanError: LoRA names mergeflow cannot parse, several adapters, a config that does not
            reproduce the checkpoint, or (with `merge`) modules whose LoRA cannot be folded.
    """
    checkpoint_dir = Path(index.checkpoint_dir)
    lora_names = lora_tensor_names(index.tensors)
    if not lora_names:
        if merge or lora_alpha is not None:
            flag = "--merge-lora" if merge else "--lora-alpha"
            raise OptionError(f"{flag} given, but checkpoint {checkpoint_dir} holds no LoRA tensors")
        return None
    modules, adapter_name = _adapted_modules(lora_names, checkpoint_dir)
    ranks = {module: index.tensors[parts["lora_A"]].shape[0] for module, parts in modules.items()}
    alpha, alpha_source = resolve_alpha(checkpoint_dir, lora_alpha)
    lora_only = len(lora_names) == len(index.tensors)
    from peft import get_peft_model

    base_model = build_meta_model(spec)
    config = infer_lora_config(
        base_model,
        ranks,
        alpha=alpha,
        use_dora=any("lora_magnitude_vector" in parts for parts in modules.values()),
        lora_bias=any("lora_B.bias" in parts for parts in modules.values()),
        trained_copies=_trained_copies(index.tensors),
        task_type=_task_type(checkpoint_dir, spec),
        source_config=_read_source_config(checkpoint_dir),
    )
    peft_model = get_peft_model(base_model, copy.deepcopy(config), adapter_name=adapter_name)
    _check_reproduces(peft_model, index, lora_only=lora_only, config=config)
    adapter_tensors = _adapter_file_keys(peft_model, adapter_name, set(index.tensors))
    base_sources = {} if lora_only else _base_sources(index.tensors, merge=merge)
    folds = _folds(peft_model, adapter_name, spec, checkpoint_dir) if merge else {}
    if merge and lora_only:
        raise OptionError(
            f"--merge-lora needs base weights, but {checkpoint_dir} is a LoRA-only checkpoint "
            "(verl's save_lora_only, or a Megatron run's adapters): merge without --merge-lora to get the adapter"
        )
    notes = []
    if lora_only:
        notes.append(
            "LoRA-only checkpoint (verl's save_lora_only, or a Megatron run's adapters): wrote the adapter without "
            f"a base model; load it with PeftModel.from_pretrained on the base model named in {spec.config_dir}/config.json"
        )
    return LoraPlan(
        config=peft_model.peft_config[adapter_name],
        adapter_name=adapter_name,
        adapter_tensors=adapter_tensors,
        base_sources=base_sources,
        folds=folds,
        merge=merge,
        lora_only=lora_only,
        alpha_source=alpha_source,
        notes=tuple(notes),
    )


def _strip(name: str) -> str:
    return name.removeprefix(PEFT_PREFIX)


def _adapted_modules(lora_names: list[str], checkpoint_dir: Path) -> tuple[dict[str, dict[str, str]], str]:
    """Each adapted module (HF module path) -> its LoRA parts (`lora_A`, `lora_B.bias`, ...) -> tensor name."""
    modules: dict[str, dict[str, str]] = {}
    adapters = set()
    unparsed = []
    for name in lora_names:
        match = LORA_KEY.match(_strip(name))
        if match is None:
            unparsed.append(name)
            continue
        adapters.add(match["adapter"])
        part = match["part"].replace("lora_embedding_", "lora_")
        if match["param"] == "bias":
            part += ".bias"
        modules.setdefault(match["module"], {})[part] = name
    if unparsed:
        raise PlanError(
            f"LoRA tensor(s) in {checkpoint_dir} that mergeflow cannot map onto PEFT modules: {quoted(unparsed)}"
        )
    if len(adapters) > 1:
        raise PlanError(f"checkpoint {checkpoint_dir} holds several LoRA adapters ({quoted(adapters)}): one is supported")
    incomplete = sorted(module for module, parts in modules.items() if not {"lora_A", "lora_B"} <= parts.keys())
    if incomplete:
        raise PlanError(f"LoRA module(s) in {checkpoint_dir} without both lora_A and lora_B: {quoted(incomplete)}")
    return modules, adapters.pop()


def _trained_copies(names) -> list[str]:
    return sorted({match["module"] for name in names if (match := TRAINED_COPY_KEY.match(_strip(name)))})


def read_train_meta(checkpoint_dir: Path) -> dict | None:
    path = Path(checkpoint_dir) / LORA_META_FILE
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e
    if not isinstance(meta, dict):
        raise CheckpointError(f"cannot read {path}: expected a JSON object, got {type(meta).__name__}")
    return meta


def _source_config_path(checkpoint_dir: Path) -> Path | None:
    paths = [Path(checkpoint_dir) / folder / ADAPTER_CONFIG_FILE for folder in SOURCE_ADAPTER_DIRS]
    return next((path for path in paths if path.is_file()), None)


def _read_source_config(checkpoint_dir: Path) -> "LoraConfig | None":
    path = _source_config_path(checkpoint_dir)
    if path is None:
        return None
    from peft import LoraConfig

    try:
        return LoraConfig.from_pretrained(str(path.parent))
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"cannot read {path} as a PEFT LoRA config: {e}") from e


def recorded_alpha(checkpoint_dir: Path) -> tuple[float | int, str] | None:
    """lora_alpha as the checkpoint records it, and where: verl's lora_train_meta.json, else an adapter config
    (None when neither records one)."""
    meta = read_train_meta(checkpoint_dir) or {}
    if meta.get("lora_alpha"):
        return _plain_number(float(meta["lora_alpha"])), str(Path(checkpoint_dir) / LORA_META_FILE)
    source_config = _read_source_config(checkpoint_dir)
    if source_config is not None and source_config.lora_alpha:
        return _plain_number(float(source_config.lora_alpha)), str(_source_config_path(checkpoint_dir))
    return None


def resolve_alpha(checkpoint_dir: Path, flag_alpha: float | None) -> tuple[float | int, str]:
    """lora_alpha from lora_train_meta.json, else the checkpoint's adapter config, else the flag.

    A 0 in the metadata is what verl records when it lost the value, so it counts as missing.
    """
    found = recorded_alpha(checkpoint_dir)
    if found is not None:
        alpha, source = found
        if flag_alpha is not None and float(flag_alpha) != alpha:
            raise OptionError(f"--lora-alpha {flag_alpha:g} contradicts lora_alpha={alpha:g} in {source}")
        return alpha, source
    if flag_alpha is not None:
        if flag_alpha <= 0:
            raise OptionError(f"--lora-alpha must be positive, got {flag_alpha}")
        return _plain_number(float(flag_alpha)), "--lora-alpha"
    adapter_configs = " or ".join(f"{folder}/{ADAPTER_CONFIG_FILE}" for folder in SOURCE_ADAPTER_DIRS)
    raise CheckpointError(
        f"LoRA checkpoint {checkpoint_dir} records no lora_alpha (no {LORA_META_FILE} with a non-zero "
        f"lora_alpha, no {adapter_configs}): pass --lora-alpha with the value used in training (verl's "
        "actor_rollout_ref.model.lora_alpha); an alpha of 0 would silently disable the adapter"
    )


def _plain_number(value: float) -> float | int:
    return int(value) if value.is_integer() else value


def _task_type(checkpoint_dir: Path, spec: ModelSpec) -> str:
    meta = read_train_meta(checkpoint_dir) or {}
    source_config = _read_source_config(checkpoint_dir)
    if meta.get("task_type"):
        return str(meta["task_type"])
    if source_config is not None and source_config.task_type:
        return str(getattr(source_config.task_type, "value", source_config.task_type))
    return "TOKEN_CLS" if spec.is_value_model else "CAUSAL_LM"


def infer_lora_config(
    base_model: torch.nn.Module,
    ranks: dict[str, int],
    *,
    alpha: float,
    use_dora: bool = False,
    lora_bias: bool = False,
    trained_copies: list[str] = (),
    task_type: str = "CAUSAL_LM",
    source_config: "LoraConfig | None" = None,
) -> "LoraConfig":
    """The LoRA config that adapts exactly the modules in `ranks` (HF module path -> rank) of `base_model`.

    Target modules are leaf names (`q_proj`) where every module of that name is adapted, and full
    module paths otherwise; ranks other than the most common go to `rank_pattern`. A config saved in
    the checkpoint supplies what names and shapes cannot tell (alpha_pattern, use_rslora).
    """
    from peft import LoraConfig

    rank, _ = Counter(ranks.values()).most_common(1)[0]
    settings = {}
    if source_config is not None:
        settings = {
            "alpha_pattern": dict(source_config.alpha_pattern or {}),
            "use_rslora": bool(source_config.use_rslora),
            "fan_in_fan_out": bool(source_config.fan_in_fan_out),
        }
    return LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=_target_modules(base_model, set(ranks), set(trained_copies)),
        rank_pattern=_rank_pattern(ranks, rank),
        modules_to_save=list(trained_copies) or None,
        use_dora=use_dora,
        lora_bias=lora_bias,
        task_type=task_type,
        inference_mode=True,
        **settings,
    )


def _leaf(module: str) -> str:
    return module.rsplit(".", 1)[-1]


def _target_modules(base_model: torch.nn.Module, adapted: set[str], trained_copies: set[str]) -> list[str]:
    by_leaf: dict[str, set[str]] = {}
    for name, module in base_model.named_modules():
        if name and not list(module.children()) and not any(name.startswith(t) for t in trained_copies):
            by_leaf.setdefault(_leaf(name), set()).add(name)
    targets = []
    for leaf in sorted({_leaf(module) for module in adapted}):
        if by_leaf.get(leaf, set()) <= adapted:
            targets.append(leaf)
        else:
            targets.extend(sorted(module for module in adapted if _leaf(module) == leaf))
    return targets


def _rank_pattern(ranks: dict[str, int], rank: int) -> dict[str, int]:
    pattern = {}
    for leaf in sorted({_leaf(module) for module in ranks}):
        leaf_ranks = {module: r for module, r in ranks.items() if _leaf(module) == leaf}
        if len(set(leaf_ranks.values())) == 1:
            if (leaf_rank := next(iter(leaf_ranks.values()))) != rank:
                pattern[leaf] = leaf_rank
        else:
            pattern.update({module: r for module, r in sorted(leaf_ranks.items()) if r != rank})
    return pattern


def _check_reproduces(peft_model: torch.nn.Module, index: TensorIndex, *, lora_only: bool, config: "LoraConfig") -> None:
    expected = {name: tuple(tensor.shape) for name, tensor in peft_model.state_dict().items()}
    if lora_only:
        expected = {name: shape for name, shape in expected.items() if name in lora_tensor_names(expected)}
    present = {name: source.shape for name, source in index.tensors.items()}
    missing = sorted(expected.keys() - present.keys())
    unexpected = sorted(present.keys() - expected.keys())
    mismatched = [
        f"{name}: got {present[name]}, expected {expected[name]}"
        for name in sorted(expected.keys() & present.keys())
        if expected[name] != present[name]
    ]
    if missing or unexpected or mismatched:
        found = [
            f"missing {quoted(missing[:10])}" if missing else "",
            f"unexpected {quoted(unexpected[:10])}" if unexpected else "",
            f"shape mismatch {'; '.join(mismatched[:10])}" if mismatched else "",
        ]
        raise PlanError(
            f"the LoRA config inferred for {index.checkpoint_dir} (r={config.r}, "
            f"target_modules={sorted(config.target_modules)}, rank_pattern={config.rank_pattern}) does not "
            "reproduce its tensors as PEFT builds them: " + ", ".join(part for part in found if part)
        )


def _adapter_file_keys(peft_model: torch.nn.Module, adapter_name: str, present: set[str]) -> dict[str, str]:
    """PEFT's own choice of adapter-file names, mapped back to checkpoint names by tensor identity."""
    from peft import get_peft_model_state_dict

    state = peft_model.state_dict()
    name_of = {id(tensor): name for name, tensor in state.items()}
    saved = get_peft_model_state_dict(
        peft_model, state_dict=state, adapter_name=adapter_name, save_embedding_layers=False
    )
    return {key: name_of[id(tensor)] for key, tensor in saved.items() if name_of[id(tensor)] in present}


def _base_sources(names, *, merge: bool) -> dict[str, str]:
    """HF name -> checkpoint name for the base model: adapter wrappers removed, LoRA tensors left out.

    A `modules_to_save` module contributes its trained copy when LoRA is folded in, and its
    original otherwise (the adapter file then carries the trained copy).
    """
    sources = {}
    for name in names:
        if lora_tensor_names([name]):
            continue
        stripped = _strip(name)
        trained = TRAINED_COPY_KEY.match(stripped)
        if trained is not None:
            if merge:
                sources[f"{trained['module']}.{trained['param']}"] = name
            continue
        if ORIGINAL_COPY_MARKER in stripped:
            if merge:
                continue
            stripped = stripped.replace(ORIGINAL_COPY_MARKER, ".")
        sources[stripped.replace(".base_layer.", ".")] = name
    return sources


def _folds(peft_model: torch.nn.Module, adapter_name: str, spec: ModelSpec, checkpoint_dir: Path) -> dict[str, LoraFold]:
    from peft.tuners import lora

    folds = {}
    unsupported = []
    tied_targets = set(spec.tied.values())
    for name, layer in peft_model.named_modules():
        if not isinstance(layer, lora.LoraLayer):
            continue
        if adapter_name not in layer.lora_A and adapter_name not in layer.lora_embedding_A:
            continue
        module = _strip(name)
        weight = f"{module}.weight"
        is_embedding = isinstance(layer, lora.Embedding)
        transposed = is_embedding or bool(getattr(layer, "fan_in_fan_out", False))
        dora = bool(layer.use_dora.get(adapter_name, False))
        reason = None
        if not (is_embedding or isinstance(layer, lora.Linear)):
            reason = f"{type(layer).__name__} layers are not supported"
        elif layer.lora_bias.get(adapter_name, False):
            reason = "lora_bias is not supported"
        elif dora and transposed:
            reason = "DoRA on embeddings or fan-in-fan-out layers is not supported"
        elif weight in tied_targets:
            reason = "its weight is tied to another module, which PEFT leaves unadapted"
        if reason:
            unsupported.append(f"{module} ({reason})")
            continue
        lora_part = "lora_embedding_" if is_embedding else "lora_"
        suffix = "" if is_embedding else ".weight"
        folds[weight] = LoraFold(
            lora_a=f"{name}.{lora_part}A.{adapter_name}{suffix}",
            lora_b=f"{name}.{lora_part}B.{adapter_name}{suffix}",
            scaling=float(layer.scaling[adapter_name]),
            transposed=transposed,
            magnitude=f"{name}.lora_magnitude_vector.{adapter_name}.weight" if dora else None,
        )
    if unsupported:
        raise PlanError(
            f"cannot fold the LoRA of {checkpoint_dir} into its base weights: " + "; ".join(unsupported)
            + ". Merge without --merge-lora to write the adapter instead."
        )
    return folds
