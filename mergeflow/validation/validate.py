"""Validation of merged models: completeness, tensor-by-tensor comparison with a reference, logits.

Tensors are compared bit for bit by default: a merge only copies and casts, so a correct merge
equals the reference exactly once both are in the same dtype (a floating reference in another dtype
is cast to the merged one first, as the merge cast the trained tensors, and the report says so). `atol`/`rtol` loosen the comparison for references that went through
other arithmetic. Logits are compared with the tolerances of `LOGITS_TOLERANCES`, in the merged
model's dtype, because kernels may differ with memory alignment in the last bits.
"""

import dataclasses
import os
from collections.abc import Callable, Collection, Iterable
from pathlib import Path

import torch

from mergeflow import fp8
from mergeflow.dtypes import DTYPE_CHOICES, dtype_name
from mergeflow.errors import quoted
from mergeflow.options import Reference
from mergeflow.output.model_folder import (
    SafetensorsFolder,
    TensorInfo,
    completeness_problems,
    dominant_floating_dtype,
    open_model_folder,
    weight_counts,
)
from mergeflow.output.streaming import CHUNK_BYTES, row_ranges
from mergeflow.planning import mtp_layer_names
from mergeflow.spec.config_files import CONFIG_FILE
from mergeflow.spec.model_spec import load_model_spec, swapped
from mergeflow.spec.peft_names import ADAPTER_SUBDIR
from mergeflow.validation.report import LogitsCheck, TensorDifference, ValidationReport

LOGITS_TOLERANCES: dict[torch.dtype, float] = {
    torch.float32: 1e-5,
    torch.float16: 1e-3,
    torch.bfloat16: 1e-2,
}
"""Absolute tolerance on logits, by the dtype both models run in."""
FP8_LOGITS_TOLERANCE = 0.15
"""For an FP8 model: the largest logit difference allowed, as a share of the reference's largest logit
(measured 0.3-10% on the test models, random weights that amplify rounding more than trained ones do)."""
LOGITS_SEQUENCE_LENGTH = 16
LOGITS_MEMORY_FACTOR = 3
"""Both models must fit in available memory this many times over their weights, or logits are skipped."""
MAX_REPORTED = 20


def reference_arguments(reference: Reference | None) -> dict:
    """`validate_model_dir`'s arguments for a reference (none without one)."""
    if reference is None:
        return {}
    return {
        "reference_dir": Path(reference.test_hf_dir),
        "check_logits": reference.check_logits,
        "atol": reference.atol,
        "rtol": reference.rtol,
    }


def validate_model_dir(
    model_dir: Path,
    *,
    reference_dir: Path | None = None,
    check_logits: bool = False,
    atol: float = 0.0,
    rtol: float = 0.0,
    shown_as: str | None = None,
    fp8_errors: dict[str, float] | None = None,
    fp8_outside: tuple[str, ...] = (),
    mtp_dropped: bool = False,
) -> ValidationReport:
    """Check a merged folder's completeness and, given a reference, its tensors (and optionally logits).

    A merged model in another floating dtype than the reference is compared with the reference cast to the
    merged dtype, as the merge cast the trained tensors; the report says so; FP8 weights are dequantized and
    compared within FP8's rounding bound. `fp8_errors` and `fp8_outside` are the rounding errors the merge
    measured against its source as it quantized. `shown_as` names the folder in the report (a staging
    directory is validated before it becomes the target). With `mtp_dropped` (a merge with `--drop-mtp`), the
    reference's multi-token-prediction layers are not looked for.
    """
    problems = completeness_problems(model_dir)
    name = shown_as or str(model_dir)
    adapter_only = (Path(model_dir) / ADAPTER_SUBDIR).is_dir() and not (Path(model_dir) / CONFIG_FILE).exists()
    if reference_dir is not None and adapter_only:
        problems.append(f"{name} holds a LoRA adapter only: no base model to compare with {reference_dir}")
    problems += [f"FP8 weight {weight} has elements outside FP8's rounding bound of its source" for weight in fp8_outside]
    weight_files, tensors = weight_counts(Path(model_dir)) if not problems else (0, 0)
    fp8_errors = fp8_errors or {}
    counts = {
        "weight_files": weight_files,
        "tensors": tensors,
        "fp8_weights": len(fp8_errors),
        "fp8_max_relative_error": max(fp8_errors.values(), default=None),
    }
    quantized = tuple(
        TensorDifference(weight, "float8_e4m3fn", (), 0.0, int(weight in fp8_outside), error)
        for weight, error in sorted(fp8_errors.items(), key=lambda item: -item[1])[:MAX_REPORTED]
    )
    if problems or reference_dir is None:
        return ValidationReport(
            name, str(reference_dir) if reference_dir else None, tuple(problems), largest_differences=quantized, **counts
        )
    spec = load_model_spec(Path(model_dir))
    report = compare_to_reference(
        SafetensorsFolder(model_dir),
        reference_dir,
        model_dir=name,
        tied=spec.tied,
        transposed=spec.transposed_on_disk,
        left_out=(lambda names: mtp_layer_names(names, spec)) if mtp_dropped else None,
        atol=atol,
        rtol=rtol,
    )
    logits = compare_logits(Path(model_dir), Path(reference_dir)) if check_logits and report.passed else None
    return dataclasses.replace(report, logits=logits, **counts)


def compare_to_reference(
    candidate,
    reference_dir: Path,
    *,
    model_dir: str,
    tied: dict[str, str],
    transposed: dict[str, tuple[int, int]] | None = None,
    left_out: Callable[[list[str]], Iterable[str]] | None = None,
    atol: float = 0.0,
    rtol: float = 0.0,
    chunk_bytes: int = CHUNK_BYTES,
    values_of: Collection[str] | None = None,
) -> ValidationReport:
    """Compare a tensor source with the reference folder: key sets, shapes, dtypes, then values, streamed. A tensor
    named in `transposed` (a model's `transposed_on_disk`) may be held in either layout by either side; the
    reference's tensors that `left_out` picks from its names (what the merge was asked to leave out) are not looked
    for. With `values_of`, only those tensors are compared (one weight file's, say: `combined` joins the parts), and
    the key sets only when it is empty."""
    reference = open_model_folder(Path(reference_dir))
    scales = {name.removesuffix(fp8.SCALE_SUFFIX): name for name in candidate.names() if name.endswith(fp8.SCALE_SUFFIX)}
    compared = [name for name in candidate.names() if name not in scales.values()]
    candidate_names, reference_names = _comparable_names(compared, reference.names(), tied)
    if left_out is not None:
        reference_names -= set(left_out(reference.names()))
    problems = []
    missing = sorted(reference_names - candidate_names)
    extra = sorted(candidate_names - reference_names)
    if missing and not values_of:
        problems.append(f"missing key(s) {quoted(missing)}")
    if extra and not values_of:
        problems.append(f"extra key(s) {quoted(extra)}")
    differences = []
    casts = set()
    for name in [n for n in compared if n in reference_names and (values_of is None or n in values_of)]:
        mine, theirs = candidate.info(name), reference.info(name)
        axes = _swapped_axes(mine.shape, theirs.shape, (transposed or {}).get(name))
        if axes is not None:
            theirs = dataclasses.replace(theirs, shape=mine.shape)
        if name in scales and mine.shape == theirs.shape:
            difference = _compare_quantized(candidate, reference, name, scales[name], mine.shape, chunk_bytes)
            differences.append(difference)
            if difference.mismatched:
                problems.append(
                    f"value mismatch for FP8 weight {name}: {difference.mismatched} element(s) outside FP8's rounding "
                    f"bound of the reference, max |diff| {difference.max_abs_diff:.6g}"
                )
        elif mine.shape != theirs.shape:
            problems.append(f"shape mismatch for {name}: got {mine.shape}, expected {theirs.shape}")
        elif mine.dtype != theirs.dtype and not (mine.dtype.is_floating_point and theirs.dtype.is_floating_point):
            problems.append(
                f"dtype mismatch for {name}: got {dtype_name(mine.dtype)}, expected {dtype_name(theirs.dtype)}"
            )
        else:
            if mine.dtype != theirs.dtype:
                casts.add(f"{dtype_name(theirs.dtype)} -> {dtype_name(mine.dtype)}")
            difference = _compare_values(candidate, reference, name, mine, atol, rtol, chunk_bytes, axes)
            differences.append(difference)
            if difference.mismatched:
                problems.append(
                    f"value mismatch for {name}: {difference.mismatched} element(s) differ, "
                    f"max |diff| {difference.max_abs_diff:.6g}"
                )
    return ValidationReport(
        model_dir, str(reference_dir), tuple(problems), len(differences), _largest(differences),
        reference_casts=tuple(sorted(casts)),
    )  # fmt: skip


def combined(parts: list[ValidationReport]) -> ValidationReport:
    """One report of comparisons made in parts (`compare_to_reference`'s `values_of`): their problems, counts, largest
    differences and casts."""
    first = parts[0]
    return ValidationReport(
        first.model_dir, first.reference_dir, tuple(problem for part in parts for problem in part.problems),
        sum(part.tensors_compared for part in parts),
        _largest([difference for part in parts for difference in part.largest_differences]),
        reference_casts=tuple(sorted({cast for part in parts for cast in part.reference_casts})),
    )  # fmt: skip


def _largest(differences: list[TensorDifference]) -> tuple[TensorDifference, ...]:
    return tuple(sorted(differences, key=lambda d: (-d.max_abs_diff, -d.mismatched, d.name))[:MAX_REPORTED])


def _compare_quantized(
    candidate, reference, name: str, scale_name: str, shape: tuple[int, ...], chunk_bytes: int
) -> TensorDifference:
    """An FP8 weight against the reference: dequantized a band of whole 128-row blocks at a time, each element
    within FP8's rounding bound of the reference's (cast to float32)."""
    band = max(fp8.BLOCK, chunk_bytes // (4 * shape[1]) // fp8.BLOCK * fp8.BLOCK)
    max_abs_diff, mismatched, largest_relative = 0.0, 0, 0.0
    for start in range(0, shape[0], band):
        stop = min(start + band, shape[0])
        values = candidate.rows(name, start, stop)
        scales = candidate.rows(scale_name, start // fp8.BLOCK, -(-stop // fp8.BLOCK))
        theirs = reference.rows(name, start, stop).float()
        relative, outside = fp8.rounding_error(theirs, values, scales)
        gap = (fp8.dequantize(values, scales) - theirs).abs()
        max_abs_diff, largest_relative = max(max_abs_diff, float(gap.max())), max(largest_relative, relative)
        mismatched += outside
    return TensorDifference(name, "float8_e4m3fn", shape, max_abs_diff, mismatched, largest_relative)


def _comparable_names(candidate: list[str], reference: list[str], tied: dict[str, str]) -> tuple[set, set]:
    """Key sets with tied aliases left out where the tensor they alias is present, as transformers saves them."""
    candidate_set, reference_set = set(candidate), set(reference)
    for alias, kept in tied.items():
        if kept in candidate_set:
            candidate_set.discard(alias)
        if kept in reference_set:
            reference_set.discard(alias)
    return candidate_set, reference_set


def _swapped_axes(
    mine: tuple[int, ...], theirs: tuple[int, ...], axes: tuple[int, int] | None
) -> tuple[int, int] | None:
    """`axes`, when the two shapes differ by exactly their swap (and the rows compared stay the same rows)."""
    if axes is None or mine == theirs or 0 in axes:
        return None
    return axes if swapped(theirs, axes) == tuple(mine) else None


def _compare_values(
    candidate,
    reference,
    name: str,
    info: TensorInfo,
    atol: float,
    rtol: float,
    chunk_bytes: int,
    transposed_axes: tuple[int, int] | None = None,
) -> TensorDifference:
    """Compare one tensor a band of rows at a time (the reference's transposed on `transposed_axes`)."""
    max_abs_diff, mismatched = 0.0, 0
    for start, stop in row_ranges(info.shape, info.dtype.itemsize, chunk_bytes):
        theirs = reference.rows(name, start, stop)
        if transposed_axes is not None:
            theirs = theirs.transpose(*transposed_axes)
        mine, theirs = candidate.rows(name, start, stop), theirs.to(info.dtype)
        if atol == 0 and rtol == 0:
            different = _bits(mine) != _bits(theirs)
        else:
            different = ~torch.isclose(mine, theirs, atol=atol, rtol=rtol, equal_nan=True)
        count = int(different.sum())
        if count:
            mismatched += count
            gap = (mine.double() - theirs.double()).abs().nan_to_num(nan=float("inf"))
            max_abs_diff = max(max_abs_diff, float(gap.max()))
    return TensorDifference(name, dtype_name(info.dtype), info.shape, max_abs_diff, mismatched)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as same-width integers, so equality is bit for bit (-0.0 and NaNs included)."""
    integer = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    return tensor.contiguous().view(integer) if tensor.dtype != torch.bool else tensor


def compare_logits(model_dir: Path, reference_dir: Path) -> LogitsCheck:
    """Load both models with transformers on CPU, in the merged dtype, and compare logits on a fixed sequence
    (an FP8 model is dequantized on load, and allowed FP8_LOGITS_TOLERANCE of the reference's largest logit)."""
    weights = sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if weights * LOGITS_MEMORY_FACTOR > available:
        return LogitsCheck(
            False,
            True,
            f"logits not compared: two {weights / 1e9:.1f} GB models do not fit in "
            f"{available / 1e9:.1f} GB of available memory",
        )
    import transformers

    spec = load_model_spec(Path(model_dir))
    model_class = getattr(transformers, spec.model_class)
    config = transformers.AutoConfig.from_pretrained(model_dir, trust_remote_code=spec.trust_remote_code)
    dtype = getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    input_ids = torch.arange(1, LOGITS_SEQUENCE_LENGTH + 1).unsqueeze(0) % config.get_text_config().vocab_size
    outputs = []
    for directory in (model_dir, reference_dir):
        model = model_class.from_pretrained(
            directory, dtype=dtype, trust_remote_code=spec.trust_remote_code
        ).eval()
        with torch.no_grad():
            outputs.append(model(input_ids).logits.double())
        del model
    gap = float((outputs[0] - outputs[1]).abs().max())
    tolerance = LOGITS_TOLERANCES.get(dtype, LOGITS_TOLERANCES[torch.float32])
    if getattr(config, "quantization_config", None):  # FP8 weights, dequantized on load
        tolerance = max(tolerance, FP8_LOGITS_TOLERANCE * float(outputs[1].abs().max()))
    passed = gap <= tolerance
    verdict = "match" if passed else "differ"
    return LogitsCheck(
        True,
        passed,
        f"logits {verdict} in {dtype_name(dtype)}: max |diff| {gap:.6g} (tolerance {tolerance:g})",
        gap,
    )


def reference_dtype_choice(reference_dir: Path) -> str:
    """The `--dtype` choice matching the reference's floating tensors (by bytes), for `mergeflow test`."""
    dominant = dominant_floating_dtype(open_model_folder(Path(reference_dir))) or torch.float32
    return next((choice for choice, dtype in DTYPE_CHOICES.items() if dtype == dominant), "keep")
