"""Checkpoint formats, one folder per backend. Each finds its files without torch (`layout`) and indexes
and reads its tensors behind the protocols of `formats.base`."""

from collections.abc import Callable
from pathlib import Path

from mergeflow.errors import CheckpointError, OptionError
from mergeflow.formats.base import Layout
from mergeflow.formats.fsdp.layout import find_rank_files
from mergeflow.formats.megatron.layout import find_megatron_checkpoint

FINDERS: dict[str, Callable[[Path], Layout]] = {
    "fsdp": find_rank_files,
    "megatron": find_megatron_checkpoint,
}
"""Each backend (`--backend` name) and how it finds a checkpoint's files."""
BACKENDS = tuple(FINDERS)


def check_backend(backend: str) -> None:
    if backend not in FINDERS:
        raise OptionError(f"backend '{backend}' is not supported: choose one of {', '.join(BACKENDS)}")


def find_checkpoint(local_dir: str | Path, backend: str) -> Layout:
    """The checkpoint's files, in the backend's layout.

    Raises:
        CheckpointError: missing, incomplete, or not in the backend's layout (naming the directory to pass
            where the user pointed at a parent).
        OptionError: an unknown backend.
    """
    check_backend(backend)
    try:
        return FINDERS[backend](Path(local_dir))
    except CheckpointError as error:
        other = _backend_that_finds(Path(local_dir), exclude=backend)
        if other is None or error.hint is not None:
            raise
        raise CheckpointError(str(error), hint=f"it is a {other} checkpoint: pass --backend {other}") from error


def _backend_that_finds(local_dir: Path, *, exclude: str) -> str | None:
    """Another backend whose layout the directory is in, if any."""
    for backend, finder in FINDERS.items():
        if backend == exclude:
            continue
        try:
            finder(local_dir)
        except CheckpointError:
            continue
        return backend
    return None
