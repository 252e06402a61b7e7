"""Caching of merged state with Prefect's own means: a transaction per merge, keyed by its `MergeKey`, holds
the merge's lock and records the published manifest; every step is cached under the merge's key."""

import dataclasses
import hashlib
import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from prefect import task
from prefect.cache_policies import CacheKeyFnPolicy
from prefect.results import get_result_store
from prefect.serializers import JSONSerializer
from prefect.settings import PREFECT_TASKS_REFRESH_CACHE, get_current_settings, temporary_settings
from prefect.transactions import IsolationLevel, Transaction, transaction

from mergeflow.fingerprint import MergeKey
from mergeflow.output.manifest import SavedModel, output_intact
from mergeflow.tasks.locks import ProcessAwareLockManager


def lock_directory() -> Path:
    return Path(get_current_settings().home) / "mergeflow" / "locks"


KEYED_PARAMETERS = ("filename", "reference")
"""Step parameters that change a step's result beyond the merge itself (which file, which reference)."""


def step_key(context, parameters: dict) -> str:
    """A step's cache key: the merge's key, the step, and a digest of what else changes its result."""
    extra = {name: _as_json(parameters[name]) for name in KEYED_PARAMETERS if name in parameters}
    key = f"{parameters['job'].key().digest}-{context.task.name}"
    return f"{key}-{hashlib.sha256(json.dumps(extra, sort_keys=True).encode()).hexdigest()[:16]}" if extra else key


def _as_json(value: object) -> object:
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def _lock_manager() -> ProcessAwareLockManager:
    return ProcessAwareLockManager(lock_files_directory=lock_directory())


MERGE_STEP = CacheKeyFnPolicy(cache_key_fn=step_key).configure(
    lock_manager=_lock_manager(), isolation_level="SERIALIZABLE"
)
"""Every step of a merge is cached under the merge's key (the flow decides, under the merge's lock, whether
the cached steps may be reused: `merge_transaction`)."""


def merge_step(name: str, **options):
    """A step of the merge flow: a task cached under the merge's key, its result (a small manifest) stored as
    JSON, never pickled."""

    def decorate(function):
        return task(function, name=name, cache_policy=MERGE_STEP, persist_result=True, result_serializer="json", **options)

    return decorate


@dataclass
class MergeRecord:
    """What a merge's transaction knows: whether this merge was published before, and what to record."""

    transaction: Transaction
    merged_before: bool
    """The target held this merge's output at some point (so it may be replaced without --overwrite)."""
    reuse: bool
    """That output is still in place, unchanged: the cached steps stand."""

    def record(self, saved: SavedModel) -> None:
        """The published manifest, written when the transaction commits."""
        self.transaction.stage(saved)


@contextmanager
def merge_transaction(key: MergeKey, staging_dir: Path, *, refresh: bool = False) -> Iterator[MergeRecord]:
    """Hold the merge's lock (a second run of the same merge waits here, then finds the first one's record)
    and decide whether the cached steps stand: the target must still hold, unchanged, the manifest this
    merge recorded when it published. Otherwise, or with `refresh`, every step runs again. A failure inside
    removes `staging_dir` (nothing half-written is left beside the target); a crash leaves it for the next
    run to resume."""
    store = get_result_store().model_copy(
        update={"lock_manager": _lock_manager(), "serializer": JSONSerializer(), "metadata_storage": None}
    )
    with transaction(key=key.digest, store=store, isolation_level=IsolationLevel.SERIALIZABLE, overwrite=True) as txn:
        previous = txn.read() if store.exists(key.digest) else None
        manifest = previous.result if previous is not None else None
        reuse = manifest is not None and not refresh and output_intact(manifest)
        try:
            with temporary_settings({PREFECT_TASKS_REFRESH_CACHE: not reuse}):
                yield MergeRecord(txn, merged_before=manifest is not None, reuse=reuse)
        except Exception:
            shutil.rmtree(staging_dir, ignore_errors=True)
            raise
