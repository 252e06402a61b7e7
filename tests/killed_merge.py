"""`python -m tests.killed_merge N ARGS...`: run `mergeflow merge ARGS...`, and SIGKILL the process as soon as
N output shards are written: a merge killed part way, as by the OOM killer or a pre-empted node."""

import os
import signal
import sys
import threading

import mergeflow.tasks.write_shard as write_shard_task
from mergeflow.cli import main

_write = write_shard_task.write_shard_file
_lock = threading.Lock()
_written = 0


def _write_then_die(*args, **kwargs):
    global _written
    result = _write(*args, **kwargs)
    with _lock:
        _written += 1
        if _written == int(sys.argv[1]):
            os.kill(os.getpid(), signal.SIGKILL)
    return result


if __name__ == "__main__":
    write_shard_task.write_shard_file = _write_then_die
    sys.exit(main(sys.argv[2:]))
