"""`mergeflow watch RUN_DIR`: announce each complete verl checkpoint as a Prefect event, once.

verl writes `latest_checkpointed_iteration.txt` in the run root after a checkpoint's files (and, in its v2
Megatron layout, after `ckpt_contents.json`), so the watcher acts on that file only: a directory still being
written is never announced. What was announced is recorded in a state file, so a restarted watcher does not
announce it again; event ids are deterministic too (same checkpoint files, same id).
"""

import contextlib
import hashlib
import json
import logging
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from prefect.events import emit_event
from prefect.settings import get_current_settings
from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from mergeflow.formats.verl_run import TRACKER_FILE
from mergeflow.output.manifest import file_listing
from mergeflow.run_layout import Checkpoint, complete_checkpoints

EVENT_NAME = "mergeflow.checkpoint.saved"
RESOURCE_PREFIX = "mergeflow.checkpoint."
EVENT_NAMESPACE = uuid.UUID("6f1c3d2e-7a1b-4c55-9f0e-3b8d2a4c6e10")

logger = logging.getLogger("mergeflow.watch")


def resource_id(checkpoint: Checkpoint) -> str:
    """`mergeflow.checkpoint.<hash of the checkpoint's path>`."""
    return RESOURCE_PREFIX + hashlib.sha256(checkpoint.local_dir.encode()).hexdigest()[:16]


def checkpoint_version(checkpoint: Checkpoint) -> str:
    """The checkpoint's files by name, size and mtime: the same files give the same version."""
    listing = file_listing(Path(checkpoint.local_dir))
    return hashlib.sha256(json.dumps(listing).encode()).hexdigest()


def event_id(checkpoint: Checkpoint, version: str) -> uuid.UUID:
    return uuid.uuid5(EVENT_NAMESPACE, f"{checkpoint.local_dir}@{version}")


def announce(checkpoint: Checkpoint, version: str) -> None:
    """Emit `mergeflow.checkpoint.saved` for one checkpoint; the payload holds what the merge deployment needs."""
    emit_event(
        event=EVENT_NAME,
        resource={
            "prefect.resource.id": resource_id(checkpoint),
            "prefect.resource.name": checkpoint.label,
        },
        payload={
            "local_dir": checkpoint.local_dir,
            "run": Path(checkpoint.run_dir).name,
            "step": checkpoint.step,
            "role": checkpoint.role,
            "backend": checkpoint.backend,
            "is_value_model": checkpoint.is_value_model,
        },
        id=event_id(checkpoint, version),
    )


def default_state_file(run_dir: Path) -> Path:
    digest = hashlib.sha256(str(Path(run_dir).absolute()).encode()).hexdigest()[:16]
    return Path(get_current_settings().home) / "mergeflow" / "watch" / f"{digest}.json"


class CheckpointWatcher:
    """Announces every complete, not yet announced checkpoint of a run directory: once at start, then on
    each write of the tracker file."""

    def __init__(
        self,
        run_dir: Path,
        state_file: Path | None = None,
        emit: Callable[[Checkpoint, str], None] = announce,
    ):
        self.run_dir = Path(run_dir).absolute()
        self.state_file = state_file or default_state_file(self.run_dir)
        self._emit = emit
        self._lock = threading.Lock()
        self._announced: dict[str, str] = (
            json.loads(self.state_file.read_text()) if self.state_file.is_file() else {}
        )
        self._observer = None

    def scan(self) -> list[Checkpoint]:
        """Announce what is complete and new (or re-saved with other files); return what was announced."""
        with self._lock:
            announced = []
            for checkpoint in complete_checkpoints(self.run_dir):
                version = checkpoint_version(checkpoint)
                if self._announced.get(checkpoint.local_dir) == version:
                    continue
                self._emit(checkpoint, version)
                self._announced[checkpoint.local_dir] = version
                self._save_state()
                logger.info("announced %s", checkpoint.label)
                announced.append(checkpoint)
            return announced

    def _save_state(self) -> None:
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        partial = self.state_file.with_name(self.state_file.name + ".partial")
        partial.write_text(json.dumps(self._announced, indent=1, sort_keys=True))
        partial.replace(self.state_file)

    def start(self) -> None:
        """Scan once, then watch the run directory."""
        self._observer = Observer()
        self._observer.schedule(_TrackerHandler(self), str(self.run_dir), recursive=False)
        self._observer.start()
        self.scan()

    def stop(self) -> None:
        if self._observer is not None:
            self._observer.stop()
            self._observer.join()


class _TrackerHandler(FileSystemEventHandler):
    def __init__(self, watcher: CheckpointWatcher):
        self._watcher = watcher

    def on_any_event(self, event: FileSystemEvent) -> None:
        paths = [event.src_path, getattr(event, "dest_path", "")]
        if event.event_type != "opened" and any(Path(str(p)).name == TRACKER_FILE for p in paths if p):
            try:
                self._watcher.scan()
            except Exception:
                logger.exception("scanning %s failed", self._watcher.run_dir)


@contextlib.contextmanager
def watching(
    run_dirs: list[str], emit: Callable[[Checkpoint, str], None] = announce
) -> Iterator[list[CheckpointWatcher]]:
    """A started watcher per run directory, stopped on exit; `emit` announces a checkpoint."""
    watchers = [CheckpointWatcher(Path(run_dir), emit=emit) for run_dir in run_dirs]
    try:
        for watcher in watchers:
            watcher.start()
        yield watchers
    finally:
        for watcher in watchers:
            watcher.stop()
