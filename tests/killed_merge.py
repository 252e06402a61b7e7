"""`python -m tests.killed_merge N ARGS...`: run `mergeflow merge ARGS...` without its write-ahead child, and
SIGKILL the process as soon as N output shards are written (not found written): a merge killed part way, as by
the OOM killer or a pre-empted node."""

import contextlib
import os
import signal
import sys
import threading

import mergeflow.output.save as save_module
from mergeflow import write_ahead
from mergeflow.cli import main

_write = save_module.write_shard
_lock = threading.Lock()
_written = 0


def _write_then_die(*args, **kwargs):
    global _written
    result = _write(*args, **kwargs)
    with _lock:
        _written += not result.resumed
        if _written == int(sys.argv[1]):
            os.kill(os.getpid(), signal.SIGKILL)
    return result


if __name__ == "__main__":
    save_module.write_shard = _write_then_die
    write_ahead.writing_ahead = lambda job: contextlib.nullcontext()
    sys.exit(main(sys.argv[2:]))
