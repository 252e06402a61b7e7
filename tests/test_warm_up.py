"""The merge's warm-up: the spec is in the cache once it ends, and a bad checkpoint is left to the pipeline."""

import subprocess
import sys
import threading

import pytest

from mergeflow.formats.fsdp.layout import default_config_dir
from mergeflow.spec import cache as spec_cache
from mergeflow.warm_up import start_warm_up

OPTIONS = {"trust_remote_code": False, "is_value_model": False}
JOIN_SECONDS = 120


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(spec_cache.CACHE_DIR_VARIABLE, str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def thread_errors(monkeypatch):
    errors = []
    monkeypatch.setattr(threading, "excepthook", errors.append)
    return errors


def stored_entries(cache) -> list:
    folder = cache / spec_cache.SPEC_SUBDIR
    return sorted(path.name for path in folder.iterdir()) if folder.is_dir() else []


def test_warm_up_stores_the_spec_of_the_checkpoints_config(fixtures, empty_cache, thread_errors):
    checkpoint_dir = fixtures["qwen2-ws2"].checkpoint_dir

    start_warm_up(str(checkpoint_dir)).join(JOIN_SECONDS)

    key = spec_cache.spec_key(default_config_dir(checkpoint_dir), OPTIONS)
    assert stored_entries(empty_cache) == [f"{key}.json"]
    assert thread_errors == []


def test_warm_up_of_a_megatron_checkpoint_stores_its_spec(megatron_fixtures, empty_cache, thread_errors):
    fixture = megatron_fixtures["megatron-qwen2-tp1"]

    start_warm_up(str(fixture.checkpoint_dir), "megatron").join(JOIN_SECONDS)

    assert len(stored_entries(empty_cache)) == 1
    assert thread_errors == []


def test_warm_up_of_a_bad_checkpoint_ends_quietly(tmp_path, empty_cache, thread_errors):
    thread = start_warm_up(str(tmp_path / "no-such-checkpoint"))
    thread.join(JOIN_SECONDS)

    assert not thread.is_alive()
    assert stored_entries(empty_cache) == []
    assert thread_errors == []


def test_the_warm_up_starts_without_importing_torch():
    """So `mergeflow merge` can start reading ahead before its imports, which take seconds."""
    check = "import sys, mergeflow.warm_up; sys.exit('torch' in sys.modules)"

    assert subprocess.run([sys.executable, "-c", check], check=False).returncode == 0
