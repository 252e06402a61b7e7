"""What speeds a merge up from outside its steps, behind two calls used alike by the CLI, the bench and the tests:
`warm_up(job)` starts reading the checkpoint ahead and, for a config not seen before, building its spec in a
child process; `writing_ahead(job)` has a child process write the weight files into the staging folder while
the caller imports Prefect and waits for its server. The flow's own shard steps then find them written and keep
them (`output.save.write_shard`). Both are for a target not written yet, and leave problems to the steps."""

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from mergeflow.job import MergeJob
from mergeflow.options import MergeOptions
from mergeflow.output.shard_locks import WRITERS_LOCK, open_to_writers, shard_writers
from mergeflow.perf import timeline
from mergeflow.perf.collector import paused_for_imports
from mergeflow.perf.fast_exit import exit_now
from mergeflow.spec.build import SpecBuild, child_environment

SPEC_BUILD_NICE = 10
"""How far `yield_to_spec_build` lowers the command's CPU priority."""


def warm_up(job: MergeJob) -> None:
    """Start reading the checkpoint ahead and, for a config not seen before, building its spec in a child process;
    both run while this process imports torch and the rest."""
    try:
        if target_written(job):
            return
        job.start_read_ahead(job.layout().data_files)
        SpecBuild(job.config_dir(), **job.spec_options())
    except Exception:
        return


@contextlib.contextmanager
def writing_ahead(job: MergeJob) -> Iterator[None]:
    """Have a child process (which first warms up) write the weight files into the staging folder while the block
    runs, on a core of its own, without sharing this process's GIL. The child stops when the block ends or the
    staging folder goes (the flow removes it when it fails, renames it when it publishes)."""
    if target_written(job):
        yield
        return
    open_to_writers(job.staging_dir)
    arguments = {
        "local_dir": job.local_dir,
        "target_dir": job.target_dir,
        "options": dataclasses.asdict(job.options),
        "parent": os.getpid(),
    }
    child = subprocess.Popen(
        [sys.executable, "-m", __name__, json.dumps(arguments)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=child_environment(),
    )
    try:
        yield
    finally:
        child.terminate()
        child.wait()
        _remove_if_unused(job.staging_dir)


def yield_to_spec_build(job: MergeJob) -> None:
    """Lower this process's CPU priority for the rest of its life when `writing_ahead`'s child builds a new config's
    spec: every write waits for that build, and this process (importing Prefect, starting the flow) would share the
    cores with it. Measured at 1.5B: about 1 s of 11 (docs/performance.md)."""
    with contextlib.suppress(Exception):  # problems are the steps' to report
        if not target_written(job) and not job.spec_stored():
            os.nice(SPEC_BUILD_NICE)


def write_weights(job: MergeJob, parent: int) -> None:
    """Warm up, then write the weight files into the staging folder while it is open to writers and process
    `parent` lives (what `writing_ahead`'s child does). For a config whose spec is being built, they are planned
    with a guessed spec until the real one is stored (`MergeJob.guess_spec`)."""
    with paused_for_imports():  # torch's import and the index
        warm_up(job)
        if job.guess_spec():
            timeline.mark("spec guessed")
        plan, _ = job.merge_plan()
    timeline.mark("plan made")
    if plan is None:
        return
    written: set[str] = set()
    with shard_writers(job.staging_dir):
        while (filename := _next_file(job, written)) is not None:
            if os.getppid() != parent:
                return
            job.write_shard(filename, written_ahead_for=parent)
            written.add(filename)


def _next_file(job: MergeJob, written: set[str]) -> str | None:
    """The next weight file to write: by the real spec's plan once it is stored, from its first file again (a file
    written with the guess is kept only if planned the same)."""
    if job.replan_with_stored_spec():
        timeline.mark("plan made with the stored spec")
        written.clear()
    plan, _ = job.merge_plan()
    if plan is None:
        return None
    return next((filename for filename in plan.shard_to_names if filename not in written), None)


def target_written(job: MergeJob) -> bool:
    """Whether the target holds files already (a cache hit, or a folder to replace): nothing to prepare."""
    target = Path(job.target_dir)
    return target.is_dir() and any(target.iterdir())


def _remove_if_unused(staging_dir: Path) -> None:
    """Remove a staging folder that holds nothing but its writers' lock (the flow never got to use it)."""
    with contextlib.suppress(OSError):
        (staging_dir / WRITERS_LOCK).unlink()
        staging_dir.rmdir()


def main(argv: list[str] | None = None) -> int:
    """`python -m mergeflow.write_ahead ARGUMENTS_JSON`: `writing_ahead`'s child."""
    timeline.mark("command started", process="write-ahead child")
    arguments = json.loads((argv or sys.argv[1:])[0])
    job = MergeJob(arguments["local_dir"], arguments["target_dir"], MergeOptions(**arguments["options"]))
    try:
        write_weights(job, arguments["parent"])
    except Exception:
        return 1
    return 0


if __name__ == "__main__":
    exit_now(main())
