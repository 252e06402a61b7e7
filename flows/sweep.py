"""The scheduled sweep: merge every complete checkpoint of one or more verl run directories not merged yet."""

from pathlib import Path

from prefect import flow, get_run_logger

from mergeflow.errors import MergeflowError
from mergeflow.flows.merge import merge_checkpoint
from mergeflow.flows.task_runners import task_runner_from
from mergeflow.options import DEFAULT_OPTIONS, HubUpload, MergeOptions
from mergeflow.run_layout import Checkpoint, complete_checkpoints


def unmerged_checkpoints(run_dirs: list[str], output_dir: str) -> list[Checkpoint]:
    """Complete checkpoints (at or below each run's tracker step) whose target under `output_dir` is missing or empty."""
    return [
        checkpoint
        for run_dir in run_dirs
        for checkpoint in complete_checkpoints(Path(run_dir))
        if not is_merged(checkpoint, output_dir)
    ]


def is_merged(checkpoint: Checkpoint, output_dir: str) -> bool:
    """Whether the checkpoint's target under `output_dir` holds files."""
    target = Path(checkpoint.target_in(output_dir))
    return target.is_dir() and any(target.iterdir())


@flow(name="sweep-checkpoints", flow_run_name="sweep {output_dir}")
def sweep_checkpoints(
    run_dirs: list[str],
    output_dir: str,
    options: MergeOptions = DEFAULT_OPTIONS,
    hub: HubUpload | None = None,
    task_runner: str = "threads",
) -> list[str]:
    """Merge each unmerged checkpoint as a `merge-checkpoint` subflow run, oldest first, in its own backend (and as
    a value model for a critic), its weight files written on `task_runner` (a `flows.task_runners` spec); one
    failure does not stop the others, and fails the sweep at the end. Returns the targets written."""
    logger = get_run_logger()
    pending = unmerged_checkpoints(run_dirs, output_dir)
    logger.info("%d checkpoint(s) to merge: %s", len(pending), ", ".join(c.label for c in pending) or "none")
    merged, failed = [], []
    merge = merge_checkpoint.with_options(task_runner=task_runner_from(task_runner))
    for checkpoint in pending:
        target_dir = checkpoint.target_in(output_dir)
        state = merge(
            local_dir=checkpoint.local_dir,
            target_dir=target_dir,
            options=checkpoint.options_from(options),
            hub=hub,
            progress=False,
            return_state=True,
        )
        (merged if state.is_completed() else failed).append(target_dir if state.is_completed() else checkpoint.label)
    if failed:
        raise MergeflowError(f"{len(failed)} of {len(pending)} merges failed: {', '.join(failed)}")
    return merged
