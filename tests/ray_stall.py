"""A Ray worker setup hook for the node-loss tests: on a node whose Ray workers see `STALL_VARIABLE`, a weight-file
write stops after its first chunk, touches the file the variable names, and waits to be killed with its node."""

import os
import time
from pathlib import Path

STALL_VARIABLE = "MERGEFLOW_TEST_STALL_WRITES"
HOOK = "tests.ray_stall.stall_writes_on_marked_node"
"""The hook, as Ray's `runtime_env={"worker_process_setup_hook": HOOK}` names it."""


def stall_writes_on_marked_node() -> None:
    started = os.environ.get(STALL_VARIABLE)
    if not started:
        return
    import mergeflow.output.save as save

    class StalledWriter(save.SafetensorsWriter):
        def write(self, name, chunk) -> None:
            super().write(name, chunk)
            Path(started).touch()
            time.sleep(3600)

    save.SafetensorsWriter = StalledWriter
