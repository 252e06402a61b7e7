"""verl run directories for the automation tests, written the way verl writes them: a step's files first,
the tracker file last."""

import shutil
from pathlib import Path

from mergeflow.demo.fsdp import Fixture
from mergeflow.formats.verl_run import TRACKER_FILE


def save_step(fixture: Fixture, run_dir: Path, step: int, *, update_tracker: bool = True) -> Path:
    """Copy the fixture's checkpoint in as `run_dir/global_step_<step>/<role>`, then (optionally) name the
    step in the tracker file, as verl does once the checkpoint's files are on disk."""
    local_dir = run_dir / f"global_step_{step}" / fixture.checkpoint_dir.name
    shutil.copytree(fixture.checkpoint_dir, local_dir)
    if update_tracker:
        (run_dir / TRACKER_FILE).write_text(str(step))
    return local_dir
