"""verl's run directory: `RUN/global_step_N/{actor,critic}`, and `RUN/latest_checkpointed_iteration.txt`,
which verl writes after a checkpoint's files, so a step at or below it is complete."""

import os
import re
from dataclasses import dataclass
from pathlib import Path

from mergeflow.errors import CheckpointError
from mergeflow.formats.fsdp import layout as fsdp_layout
from mergeflow.formats.megatron import layout as megatron_layout
from mergeflow.formats.megatron.contents import CONTENTS_FILE, is_v2_layout
from mergeflow.formats.megatron.layout import find_megatron_checkpoint

TRACKER_FILE = "latest_checkpointed_iteration.txt"
STEP_DIR = re.compile(r"^global_step_(\d+)$")
SCANNED_ENTRIES = 20_000
"""A folder with more entries than this is not an ordinary model folder: mergeflow does not replace it."""


@dataclass(frozen=True)
class Checkpoint:
    """One saved role of one step: what `mergeflow merge --local_dir` takes."""

    run_dir: str
    step: int
    role: str
    backend: str

    @property
    def local_dir(self) -> str:
        return str(Path(self.run_dir) / f"global_step_{self.step}" / self.role)

    @property
    def is_value_model(self) -> bool:
        """verl's critic is a value model."""
        return self.role == "critic"

    @property
    def label(self) -> str:
        """`run-a/step-120/actor`, for run names in the Prefect UI."""
        return f"{Path(self.run_dir).name}/step-{self.step}/{self.role}"

    def target_in(self, output_dir: str | Path) -> str:
        """Where this checkpoint's merged model goes under `output_dir`: `OUT/<run>/global_step_N/<role>`."""
        return str(Path(output_dir) / Path(self.run_dir).name / f"global_step_{self.step}" / self.role)


def latest_step(run_dir: Path) -> int | None:
    """The step the tracker file names, or None when there is none yet (or it is being rewritten)."""
    try:
        text = (Path(run_dir) / TRACKER_FILE).read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() else None


def backend_of(role_dir: Path) -> str | None:
    """`fsdp` for rank files, `megatron` for what the Megatron backend reads (a torch_dist archive, or
    mbridge's HF weights), None otherwise."""
    if fsdp_layout.detect(role_dir):
        return "fsdp"
    try:
        find_megatron_checkpoint(role_dir)
    except CheckpointError:
        return None
    return "megatron"


def is_fully_saved(role_dir: Path, backend: str) -> bool:
    """Whether the role's save has finished: verl's v2 Megatron layout writes `ckpt_contents.json` last."""
    return backend != "megatron" or not is_v2_layout(role_dir) or (role_dir / CONTENTS_FILE).is_file()


def checkpoints_of_step(run_dir: Path, step: int) -> list[Checkpoint]:
    step_dir = Path(run_dir) / f"global_step_{step}"
    found = []
    for role in fsdp_layout.ROLE_SUBDIRS:
        backend = backend_of(step_dir / role) if (step_dir / role).is_dir() else None
        if backend is not None and is_fully_saved(step_dir / role, backend):
            found.append(Checkpoint(str(Path(run_dir).absolute()), step, role, backend))
    return found


def complete_checkpoints(run_dir: Path) -> list[Checkpoint]:
    """Every checkpoint of the run at or below the tracker's step and fully saved, oldest first."""
    latest = latest_step(run_dir)
    if latest is None:
        return []
    steps = sorted(
        int(match[1])
        for path in Path(run_dir).iterdir()
        if path.is_dir() and (match := STEP_DIR.match(path.name)) and int(match[1]) <= latest
    )
    return [checkpoint for step in steps for checkpoint in checkpoints_of_step(run_dir, step)]


def label_of(local_dir: str | Path) -> str:
    """`run-a/step-120/actor` for `.../run-a/global_step_120/actor`; the path's last parts otherwise."""
    path = Path(local_dir).absolute()
    match = STEP_DIR.match(path.parent.name)
    if match:
        return f"{path.parent.parent.name}/step-{match[1]}/{path.name}"
    return "/".join(path.parts[-2:])


@dataclass(frozen=True)
class Protected:
    """A directory of the training run that a merge must never write into, replace or delete."""

    what: str
    """How error messages name it: "the checkpoint", "its config directory", "its run directory"."""
    path: Path


def protected_paths(checkpoint_dir: str | Path, config_dir: str | Path | None = None) -> tuple[Protected, ...]:
    """The checkpoint, its config directory and, for verl's `RUN/global_step_N/ROLE` layout, the step and
    run directories: a merge's target may be none of them, contain none, and lie inside none."""
    checkpoint = Path(checkpoint_dir).absolute()
    protected = [Protected("the checkpoint", checkpoint)]
    if config_dir is not None:
        protected.append(Protected("its config directory", Path(config_dir).absolute()))
    for step_dir in (checkpoint, *checkpoint.parents):
        if STEP_DIR.match(step_dir.name):
            protected += [Protected("its step directory", step_dir), Protected("its run directory", step_dir.parent)]
            break
    return tuple(protected)


def is_training_file(name: str, is_dir: bool) -> bool:
    """Whether a directory entry is part of what verl saves while training (never a merge's output)."""
    if is_dir:
        return bool(STEP_DIR.match(name)) or name == megatron_layout.DIST_CKPT_SUBDIR
    return (
        name in (TRACKER_FILE, fsdp_layout.FSDP_CONFIG_FILE, megatron_layout.METADATA_FILE, CONTENTS_FILE)
        or bool(fsdp_layout.RANK_FILE_PATTERN.match(name))
        or bool(megatron_layout.DATA_FILE.match(name))
    )


def training_files_in(folder: Path, *, limit: int = SCANNED_ENTRIES) -> list[str]:
    """Paths under `folder` that belong to a training run (rank files, `dist_ckpt/`, `global_step_*/`, the
    tracker file), without descending into them; `folder` itself when it holds more than `limit` entries."""
    found: list[str] = []
    seen = 0
    for root, dirs, files in os.walk(folder):
        seen += len(dirs) + len(files)
        if seen > limit:
            return [f"{folder} (more than {limit} entries)"]
        found += [os.path.join(root, name) for name in files if is_training_file(name, is_dir=False)]
        training_dirs = [name for name in dirs if is_training_file(name, is_dir=True)]
        found += [os.path.join(root, name) for name in training_dirs]
        dirs[:] = sorted(name for name in dirs if name not in training_dirs)
    return sorted(found)
