"""The checkpoints of verl's run directories (`formats.verl_run`'s conventions), in whichever backend's format
each was saved, and the parts of a run a merge must never touch."""

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from mergeflow.formats import registry
from mergeflow.formats.verl_run import ROLE_SUBDIRS, STEP_DIR, TRACKER_FILE, saved_steps, step_dir_name
from mergeflow.options import MergeOptions

SCANNED_ENTRIES = 20_000
"""A folder with more entries than this is not an ordinary model folder: mergeflow does not replace it."""


@dataclass(frozen=True)
class Checkpoint:
    """One saved role of one step: what `mergeflow merge --local_dir` takes."""

    run_dir: str
    step: int
    role: str
    backend: str
    in_step_dir: bool = False
    """Saved in the step's directory itself rather than its role's (verl's TorchTitan engine saves the actor so)."""

    @property
    def local_dir(self) -> str:
        step_dir = Path(self.run_dir) / step_dir_name(self.step)
        return str(step_dir if self.in_step_dir else step_dir / self.role)

    @property
    def is_value_model(self) -> bool:
        """verl's critic is a value model."""
        return self.role == "critic"

    @property
    def label(self) -> str:
        """`run-a/step-120/actor`, for run names in the Prefect UI."""
        return f"{Path(self.run_dir).name}/step-{self.step}/{self.role}"

    def options_from(self, options: MergeOptions) -> MergeOptions:
        """`options` for this checkpoint: its backend, and a value model for verl's critic."""
        return dataclasses.replace(options, backend=self.backend, is_value_model=self.is_value_model)

    def target_in(self, output_dir: str | Path) -> str:
        """Where this checkpoint's merged model goes under `output_dir`: `OUT/<run>/global_step_N/<role>`."""
        return target_path(str(Path(output_dir)), Path(self.run_dir).name, str(self.step), self.role)


TARGET_TEMPLATE = "{output}/{run}/global_step_{step}/{role}"
"""Where the automatic merges (serve, sweep, the deployments) put a checkpoint's model; `prefect.yaml` spells it
with Jinja fields (a test checks the two agree)."""


def target_path(output: str, run: str, step: str, role: str) -> str:
    """`TARGET_TEMPLATE` filled in (with values, or with the Jinja fields of an event trigger)."""
    return TARGET_TEMPLATE.format(output=output, run=run, step=step, role=role)


def latest_step(run_dir: Path) -> int | None:
    """The step the tracker file names, or None when there is none yet (or it is being rewritten)."""
    try:
        text = (Path(run_dir) / TRACKER_FILE).read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() else None


def checkpoints_of_step(run_dir: Path, step: int) -> list[Checkpoint]:
    """The step's roles that a backend recognises and whose save has finished; else the step's directory itself,
    as the actor's, when a backend recognises it (a TorchTitan archive) and its save has finished."""
    step_dir = Path(run_dir) / step_dir_name(step)
    run = str(Path(run_dir).absolute())
    found = []
    for role in ROLE_SUBDIRS:
        backend = registry.backend_of(step_dir / role) if (step_dir / role).is_dir() else None
        if backend is not None and backend.is_complete(step_dir / role):
            found.append(Checkpoint(run, step, role, backend.name))
    if found or not step_dir.is_dir():
        return found
    backend = registry.backend_of(step_dir)
    if backend is not None and backend.is_complete(step_dir):
        found.append(Checkpoint(run, step, ROLE_SUBDIRS[0], backend.name, in_step_dir=True))
    return found


def complete_checkpoints(run_dir: Path) -> list[Checkpoint]:
    """Every checkpoint of the run at or below the tracker's step and fully saved, oldest first."""
    latest = latest_step(run_dir)
    if latest is None:
        return []
    steps = [step for step in saved_steps(run_dir) if step <= latest]
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
    if is_dir and STEP_DIR.match(name):
        return True
    return (not is_dir and name == TRACKER_FILE) or registry.is_training_file(name, is_dir)


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
