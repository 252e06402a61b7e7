"""The merge-step lock: held against other holders while its process lives, released when it dies."""

import json
import os
import signal
import subprocess
import sys

from mergeflow.tasks.locks import ProcessAwareLockManager

KEY = "merge-step"
HOLD_AND_DIE = """
import os, signal, sys
from pathlib import Path
from mergeflow.tasks.locks import ProcessAwareLockManager
ProcessAwareLockManager(lock_files_directory=Path(sys.argv[1])).acquire_lock("merge-step", holder="killed run")
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_lock_is_held_against_another_holder(tmp_path):
    locks = ProcessAwareLockManager(lock_files_directory=tmp_path)
    assert locks.acquire_lock(KEY, holder="first")

    assert not locks.acquire_lock(KEY, holder="second", acquire_timeout=0.3)


def test_the_holder_may_take_its_lock_again(tmp_path):
    locks = ProcessAwareLockManager(lock_files_directory=tmp_path)
    locks.acquire_lock(KEY, holder="first")

    assert locks.acquire_lock(KEY, holder="first", acquire_timeout=0.3)


def test_a_released_lock_can_be_taken(tmp_path):
    locks = ProcessAwareLockManager(lock_files_directory=tmp_path)
    locks.acquire_lock(KEY, holder="first")
    locks.release_lock(KEY, holder="first")

    assert locks.acquire_lock(KEY, holder="second", acquire_timeout=0.3)


def test_a_lock_whose_process_was_killed_is_free(tmp_path):
    killed = subprocess.run([sys.executable, "-c", HOLD_AND_DIE, str(tmp_path)], capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr

    locks = ProcessAwareLockManager(lock_files_directory=tmp_path)
    assert locks.is_locked(KEY) is False
    assert locks.acquire_lock(KEY, holder="next run", acquire_timeout=0.3)


def test_a_lock_file_that_holds_no_record_is_free(tmp_path):
    (tmp_path / f"{KEY}.lock").write_text("")
    locks = ProcessAwareLockManager(lock_files_directory=tmp_path)

    assert locks.acquire_lock(KEY, holder="next run", acquire_timeout=0.3)


def test_a_lock_file_names_its_process(tmp_path):
    locks = ProcessAwareLockManager(lock_files_directory=tmp_path)
    locks.acquire_lock(KEY, holder="first")

    (lock_file,) = tmp_path.iterdir()
    assert json.loads(lock_file.read_text())["pid"] == os.getpid()
