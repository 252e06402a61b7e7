"""Where a merge's time goes: when MERGEFLOW_TIMELINE names a file, every process of a merge (the command, its
write-ahead and spec-build children) appends one JSON line per moment there: when it happened, which process,
what, and the process's CPU seconds and bytes read from and written to storage so far. Unset, `mark` does
nothing. The bench turns the file into the timeline it prints (`bench.timeline`)."""

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

TIMELINE_VARIABLE = "MERGEFLOW_TIMELINE"


def enabled() -> bool:
    return bool(os.environ.get(TIMELINE_VARIABLE))


def mark(event: str, *, at: float | None = None, **facts: object) -> None:
    """Append `event` with `facts` to the timeline file, if there is one: now, with this process's CPU time and I/O
    so far, or at `at` (epoch seconds) for a moment another process recorded."""
    path = os.environ.get(TIMELINE_VARIABLE)
    if not path:
        return
    moment = {"at": time.time(), "cpu_seconds": time.process_time(), **_io_bytes()} if at is None else {"at": at}
    line = {**moment, "pid": os.getpid(), "event": event, **facts}
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(
            descriptor, (json.dumps(line) + "\n").encode()
        )  # one write: lines of several processes never mix
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def span(event: str, **facts: object) -> Iterator[None]:
    """Mark `event` started at the block's start and ended at its end."""
    mark(f"{event} started", **facts)
    try:
        yield
    finally:
        mark(f"{event} ended", **facts)


def _io_bytes() -> dict[str, int]:
    """This process's bytes read from and written to storage (page-cache hits read nothing), where Linux says."""
    try:
        counters = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    except (OSError, ValueError):
        return {}
    return {"read_bytes": int(counters["read_bytes"]), "write_bytes": int(counters["write_bytes"])}
