"""Checks of a command's paths and flags that need no tensor data, no torch and no Prefect.

The CLI runs them before it imports anything heavy, so a mistake that the paths and flags already show
(a missing directory, the run root instead of `actor/`, a missing rank file, a target that overlaps the
checkpoint, a bad repo id) is answered in a fraction of a second. The pipeline checks the same things
again, with the rest, for callers that do not come through the CLI.
"""

from pathlib import Path

from mergeflow.errors import CheckpointError
from mergeflow.formats.registry import backend_of, find_checkpoint
from mergeflow.formats.verl_run import STEP_DIR
from mergeflow.options import check_repo_id, check_shard_size
from mergeflow.output.staging import check_overlap, check_target
from mergeflow.run_layout import Protected, protected_paths
from mergeflow.spec.config_files import CONFIG_FILE, require_config

REFERENCE_WEIGHTS = ("*.safetensors", "pytorch_model*.bin")


def check_checkpoint(local_dir: str | Path, backend: str, hf_model_config_path: str | Path | None = None) -> Path:
    """The checkpoint's files must be complete, and its config directory (returned) must hold config.json.

    Raises:
        CheckpointError: naming what is missing, and the directory to pass where the user pointed at a parent.
        OptionError: an unknown backend.
    """
    layout = find_checkpoint(local_dir, backend)
    config_dir = Path(hf_model_config_path or layout.config_dir)
    require_config(config_dir)
    return config_dir


def check_merge_target(target_dir: str | Path, *, overwrite: bool, protected: tuple[Protected, ...]) -> None:
    """The target's checks that need no record of earlier merges: it overlaps nothing protected, holds no
    training files, and is empty unless `overwrite` is set. A non-empty model folder is left to the
    pipeline, which knows whether it is this merge's own earlier output (a re-run then reuses it)."""
    earlier_output = (Path(target_dir) / CONFIG_FILE).is_file()
    check_target(Path(target_dir), overwrite=overwrite or earlier_output, protected=protected)


def check_reference(test_hf_dir: str | Path) -> None:
    """A reference model folder for `--test_hf_dir`: a directory holding weights.

    Raises:
        CheckpointError: it is missing or holds no weights.
    """
    directory = Path(test_hf_dir)
    if not directory.is_dir():
        raise CheckpointError(f"reference model directory not found: {directory}")
    if not any(any(directory.glob(pattern)) for pattern in REFERENCE_WEIGHTS):
        raise CheckpointError(f"no weights in {directory}: expected *.safetensors or pytorch_model*.bin files")


def check_merge(
    local_dir: str,
    target_dir: str,
    *,
    backend: str,
    hf_model_config_path: str | None,
    overwrite: bool,
    max_shard_size: str,
    test_hf_dir: str | None,
    hf_upload_path: str | None,
) -> None:
    """Everything `mergeflow merge` can check from its paths and flags."""
    check_shard_size(max_shard_size)
    if hf_upload_path:
        check_repo_id(hf_upload_path)
    config_dir = check_checkpoint(local_dir, backend, hf_model_config_path)
    check_merge_target(target_dir, overwrite=overwrite, protected=protected_paths(local_dir, config_dir))
    if test_hf_dir:
        check_reference(test_hf_dir)


def check_model_folder(target_dir: str | Path) -> None:
    """A merged model folder to validate must exist (what is in it is validation's business).

    Raises:
        CheckpointError: it is missing or not a directory.
    """
    if not Path(target_dir).is_dir():
        raise CheckpointError(f"model directory not found: {target_dir}")


def check_output_dir(output_dir: str | Path, run_dirs: list[str]) -> None:
    """Merged models of the runs go under `output_dir`, which must lie outside every run directory."""
    check_overlap(Path(output_dir), [Protected("a run directory", Path(run_dir)) for run_dir in run_dirs])


def check_run_dirs(run_dirs: list[str]) -> None:
    """Each directory to watch or sweep must be an existing verl run directory (one that holds, or will hold,
    `global_step_N/`), not a checkpoint or a step of one. A run with no checkpoint yet is fine.

    Raises:
        CheckpointError: naming the path, and the run directory to pass where it is a checkpoint or a step.
    """
    for run_dir in map(Path, run_dirs):
        if not run_dir.is_dir():
            raise CheckpointError(
                f"run directory not found: {run_dir}",
                hint="pass the directory verl saves global_step_N/ into (trainer.default_local_dir); create it first "
                "if training has not started",
            )
        absolute = run_dir.absolute()
        for depth, step_dir in enumerate((absolute, absolute.parent)):
            if STEP_DIR.match(step_dir.name):
                what = "a checkpoint" if depth else "a step directory"
                raise CheckpointError(f"{run_dir} is {what}, not a run directory: pass {step_dir.parent}")
        if backend_of(run_dir) is not None:
            raise CheckpointError(
                f"{run_dir} is a checkpoint, not a run directory (which holds global_step_N/)",
                hint=f"merge it with `mergeflow merge --local_dir {run_dir}`",
            )
