"""What a backend is to the rest of mergeflow: one record, exported by its folder of `formats/` and listed in
`formats.registry`. Run layout, pre-flight, `inspect`, the watcher and the merge job use these records only."""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mergeflow.formats.base import Layout


def always_complete(checkpoint_dir: Path) -> bool:
    return True


@dataclass(frozen=True)
class Backend:
    """One checkpoint format: its `--backend` name and how mergeflow finds, recognises and reads it."""

    name: str
    description: str
    """What it reads, for `--help` and the hint for a wrong `--backend` ("rank files of verl's FSDP engine")."""
    find: Callable[[Path], Layout]
    """The checkpoint's files in this layout; raises CheckpointError naming what is missing or wrong."""
    recognises: Callable[[Path], bool]
    """Whether a directory is (the start of) a checkpoint in this layout, from file names alone."""
    is_training_file: Callable[[str, bool], bool]
    """Whether a directory entry (name, is_dir) is something this format saves while training, which a
    merge's output may never replace."""
    needs_spec: bool
    """Whether its tensors are named through the model's config (a Megatron archive) rather than stored under
    their Hugging Face names."""
    is_complete: Callable[[Path], bool] = always_complete
    """Whether a recognised checkpoint's save has finished (beyond verl's tracker file, which covers the step)."""
