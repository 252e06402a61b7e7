"""The backends mergeflow reads, in one list: adding one is a folder of `formats/` and a line here."""

from pathlib import Path

from mergeflow.errors import CheckpointError, OptionError
from mergeflow.formats import fsdp, hf_tree, megatron, torchtitan
from mergeflow.formats.backend import Backend
from mergeflow.formats.base import Layout

BACKENDS: tuple[Backend, ...] = (
    fsdp.BACKEND,
    torchtitan.BACKEND,
    megatron.BACKEND,
    hf_tree.BACKEND,
)
"""Every backend, in the order a directory is tried when its backend is not given (the watcher's)."""
BACKEND_NAMES = tuple(backend.name for backend in BACKENDS)


def backend_named(name: str) -> Backend:
    """Raises OptionError for a name no backend has."""
    for backend in BACKENDS:
        if backend.name == name:
            return backend
    raise OptionError(f"backend '{name}' is not supported: choose one of {', '.join(BACKEND_NAMES)}")


def find_checkpoint(local_dir: str | Path, backend: str) -> Layout:
    """The checkpoint's files, in the backend's layout.

    Raises:
        CheckpointError: missing, incomplete, or not in the backend's layout (naming the directory to pass
            where the user pointed at a parent, or the backend whose layout it is).
        OptionError: an unknown backend.
    """
    chosen = backend_named(backend)
    try:
        return chosen.find(Path(local_dir))
    except CheckpointError as error:
        other = backend_of(Path(local_dir), exclude=chosen)
        if other is None or error.hint is not None:
            raise
        raise CheckpointError(
            str(error), hint=f"it is {other.description}: pass --backend {other.name}"
        ) from error


def backend_of(directory: Path, *, exclude: Backend | None = None) -> Backend | None:
    """The first backend that recognises the directory as one of its checkpoints, if any."""
    for backend in BACKENDS:
        if backend is not exclude and backend.recognises(Path(directory)):
            return backend
    return None


def is_training_file(name: str, is_dir: bool) -> bool:
    """Whether a directory entry is something a backend saves while training."""
    return any(backend.is_training_file(name, is_dir) for backend in BACKENDS)
