"""The README.md model card of a merged model: what it was merged from and how, as YAML front matter
(huggingface_hub's `ModelCardData`) and as a table. A card the checkpoint brought along is kept."""

import os
from dataclasses import asdict, dataclass
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

from mergeflow.output.staging import FILE_MODE

MODEL_CARD_FILE = "README.md"
TAGS = ["verl", "mergeflow"]


@dataclass(frozen=True)
class MergeFacts:
    """What the card reports; also written under `mergeflow:` in the front matter."""

    source: str
    step: int | None
    backend: str
    world_size: int
    dtype: str
    merge_seconds: float
    validation: str
    lora: str | None = None
    base_model: str | None = None
    quantization: str | None = None
    """How the weights were quantized, if they were."""


def write_model_card(model_dir: Path, facts: MergeFacts) -> Path | None:
    """Write README.md into `model_dir` unless one is already there; returns its path when written."""
    path = Path(model_dir) / MODEL_CARD_FILE
    if path.exists():
        return None
    _write_atomically(path, render_model_card(facts))
    return path


def render_model_card(facts: MergeFacts) -> str:
    data = ModelCardData(
        base_model=facts.base_model,
        library_name="transformers",
        tags=TAGS + (["lora"] if facts.lora else []) + (["fp8"] if facts.quantization else []),
        mergeflow={key: value for key, value in asdict(facts).items() if value is not None},
    )
    step = f"step {facts.step}" if facts.step is not None else "an unknown step"
    rows = [
        ("source checkpoint", f"`{facts.source}`"),
        ("training step", str(facts.step) if facts.step is not None else "unknown"),
        ("backend", facts.backend),
        ("world size", str(facts.world_size)),
        ("dtype", facts.dtype),
        ("merge time", f"{facts.merge_seconds:.1f} s"),
        ("validation", facts.validation),
        ("base model", facts.base_model or "not recorded"),
        ("LoRA", facts.lora or "none"),
        ("quantization", facts.quantization or "none"),
    ]
    table = "\n".join(["| | |", "| --- | --- |", *(f"| {name} | {value} |" for name, value in rows)])
    body = (
        f"# Merged verl checkpoint ({step})\n\n"
        f"Merged from a verl {facts.backend.upper()} checkpoint into a Hugging Face model by mergeflow.\n\n"
        + (f"The weights of its linear layers are FP8: {facts.quantization}.\n\n" if facts.quantization else "")
        + f"{table}\n"
    )
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}"))


def _write_atomically(path: Path, text: str) -> None:
    """Write `path` through a temporary file renamed over it, with the permissions the other files get."""
    temporary = path.with_name(f".{path.name}.partial")
    try:
        with open(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE), "w") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
