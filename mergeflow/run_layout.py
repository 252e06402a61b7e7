"""verl's run directory: `RUN/global_step_N/{actor,critic}`, and `RUN/latest_checkpointed_iteration.txt`,
which verl writes after a checkpoint's files, so a step at or below it is complete."""

import re
from dataclasses import dataclass
from pathlib import Path

from mergeflow import fsdp_layout
from mergeflow.errors import CheckpointError
from mergeflow.megatron_layout import find_megatron_checkpoint

TRACKER_FILE = "latest_checkpointed_iteration.txt"
STEP_DIR = re.compile(r"^global_step_(\d+)$")
ROLES = ("actor", "critic")


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


def checkpoints_of_step(run_dir: Path, step: int) -> list[Checkpoint]:
    step_dir = Path(run_dir) / f"global_step_{step}"
    found = []
    for role in ROLES:
        backend = backend_of(step_dir / role) if (step_dir / role).is_dir() else None
        if backend is not None:
            found.append(Checkpoint(str(Path(run_dir).absolute()), step, role, backend))
    return found


def complete_checkpoints(run_dir: Path) -> list[Checkpoint]:
    """Every checkpoint of the run at or below the tracker's step, oldest first."""
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
