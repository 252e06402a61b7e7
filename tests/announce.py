"""`python -m tests.announce RUN_DIR STEP [VERSION]`: emit a step's `mergeflow.checkpoint.saved` event as the
watcher does (with VERSION, an event the watcher never sent), to the Prefect server of the environment."""

import sys
from pathlib import Path

from prefect.events.worker import EventsWorker

from mergeflow.deployments.watcher import announce, checkpoint_version
from mergeflow.run_layout import checkpoints_of_step

if __name__ == "__main__":
    run_dir, step, *version = sys.argv[1:]
    for checkpoint in checkpoints_of_step(Path(run_dir), int(step)):
        announce(checkpoint, version[0] if version else checkpoint_version(checkpoint))
    EventsWorker.drain_all()
