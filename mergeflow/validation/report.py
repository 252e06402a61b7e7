"""What validation found, in small frozen records that tasks pass on and publish; imports no torch."""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TensorDifference:
    """How far one merged tensor is from the reference (0 and 0 when bit-identical)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    max_abs_diff: float
    mismatched: int
    """Elements outside the tolerance (with no tolerance: elements that are not bit-identical; for an FP8
    weight: elements outside FP8's rounding bound)."""
    max_relative_error: float | None = None
    """For an FP8 weight: its largest relative rounding error (`output.fp8.Quantized`)."""


@dataclass(frozen=True)
class LogitsCheck:
    compared: bool
    passed: bool
    message: str
    max_abs_diff: float | None = None


@dataclass(frozen=True)
class ValidationReport:
    """The verdict on one merged model, small enough to pass between tasks and publish as artifacts."""

    model_dir: str
    reference_dir: str | None
    problems: tuple[str, ...]
    tensors_compared: int = 0
    largest_differences: tuple[TensorDifference, ...] = field(default_factory=tuple)
    logits: LogitsCheck | None = None
    weight_files: int = 0
    """Weight files the folder's index names (checked complete)."""
    tensors: int = 0
    """Tensors those files hold."""
    reference_casts: tuple[str, ...] = ()
    """Dtype casts applied to the reference before comparing (`float32 -> bfloat16`)."""
    fp8_weights: int = 0
    """FP8 weights checked against their source: within FP8's rounding bound of the tensor quantized."""
    fp8_max_relative_error: float | None = None

    @property
    def passed(self) -> bool:
        return not self.problems and (self.logits is None or self.logits.passed)

    def verdict(self) -> str:
        """One line: passed or failed, and what was checked."""
        if self.problems:
            return f"failed ({len(self.problems)} problem(s): {self.problems[0]})"
        files = f"{self.weight_files} weight file{'s' if self.weight_files != 1 else ''}"
        checked = [f"complete ({files}, {self.tensors} tensors)"]
        if self.fp8_weights:
            checked.append(
                f"{self.fp8_weights} FP8 weights within FP8's rounding bound of their source "
                f"(largest relative error {self.fp8_max_relative_error:.4f})"
            )
        if self.reference_dir:
            cast = f" (reference cast {', '.join(self.reference_casts)})" if self.reference_casts else ""
            how = "match" if self.fp8_weights else "equal"
            fp8_note = ", FP8 weights within their rounding bound" if self.fp8_weights else ""
            checked.append(f"{self.tensors_compared} tensors {how} {self.reference_dir}{cast}{fp8_note}")
        if self.logits is not None:
            checked.append(self.logits.message)
        return f"{'passed' if self.passed else 'failed'}: {'; '.join(checked)}"

    def failure_message(self) -> str:
        shown = list(self.problems[:5])
        if self.logits is not None and not self.logits.passed:
            shown.append(self.logits.message)
        more = f" (and {len(self.problems) - 5} more)" if len(self.problems) > 5 else ""
        against = f" against {self.reference_dir}" if self.reference_dir else ""
        return f"validation of {self.model_dir}{against} failed: " + "; ".join(shown) + more
