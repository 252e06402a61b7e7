"""verl's run conventions, which every backend shares: `RUN/global_step_N/{actor,critic}`, the `huggingface/`
folder saved beside the weights, and `RUN/latest_checkpointed_iteration.txt`, which verl writes after a
checkpoint's files, so a step at or below it is complete (names only: imports no torch)."""

import re
from pathlib import Path

TRACKER_FILE = "latest_checkpointed_iteration.txt"
STEP_DIR = re.compile(r"^global_step_(\d+)$")
ROLE_SUBDIRS = ("actor", "critic")
HF_SUBDIR = "huggingface"
"""The folder verl saves beside a checkpoint's weights: the model's config, tokenizer and chat template."""
TORCHTITAN_STEP_DIR = re.compile(r"^step-(\d+)$")
"""Where verl's TorchTitan engine has torchtitan save a step: its checkpoint folder set to `global_step_N/`, torchtitan
writes `step-N/` there (a DCP archive of model, optimizer, LR scheduler and train state)."""


def step_dir_name(step: int) -> str:
    return f"global_step_{step}"


def default_config_dir(checkpoint_dir: Path) -> Path:
    """The `huggingface/` folder verl saves beside the weights (config, tokenizer)."""
    return Path(checkpoint_dir) / HF_SUBDIR


def saved_steps(run_dir: Path) -> list[int]:
    """The steps of the run's `global_step_N/` folders, oldest first."""
    return sorted(
        int(match[1]) for path in Path(run_dir).glob("global_step_*") if path.is_dir() and (match := STEP_DIR.match(path.name))
    )


def wrong_level_hint(directory: Path, is_checkpoint) -> str | None:
    """Which path to pass when the user pointed at the run directory or at `global_step_N/`: a role folder
    below `directory` that `is_checkpoint`, else the newest step's actor."""
    roles = [directory / role for role in ROLE_SUBDIRS if is_checkpoint(directory / role)]
    if roles:
        return f"pass the role directory instead: {' or '.join(map(str, roles))}"
    steps = saved_steps(directory)
    if steps:
        newest = directory / step_dir_name(steps[-1]) / ROLE_SUBDIRS[0]
        return f"this looks like a verl run directory, pass a checkpoint such as {newest}"
    return None
