"""A model spec built in a child process: looked up as if built here, reported here when the child fails."""

import subprocess
import sys

import pytest

from mergeflow.errors import CheckpointError
from mergeflow.formats.verl_run import default_config_dir
from mergeflow.spec import cache as spec_cache
from mergeflow.spec import model_spec
from mergeflow.spec.build import SpecBuild
from mergeflow.spec.model_spec import load_model_spec

CHILD_SECONDS = 120


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(spec_cache.CACHE_DIR_VARIABLE, str(tmp_path / "cache"))
    return tmp_path / "cache"


def stored(config_dir) -> bool:
    return spec_cache.is_stored(spec_cache.model_spec_key(config_dir, trust_remote_code=False, is_value_model=False))


def test_the_child_stores_the_spec_a_build_here_gives(fixtures, empty_cache, monkeypatch, tmp_path):
    config_dir = default_config_dir(fixtures["qwen2-ws2"].checkpoint_dir)
    build = SpecBuild(config_dir)

    assert build.process.wait(timeout=CHILD_SECONDS) == 0
    assert stored(config_dir)  # stored by the child, before any lookup here
    from_child = build.spec()
    monkeypatch.setenv(spec_cache.CACHE_DIR_VARIABLE, str(tmp_path / "another-cache"))
    assert load_model_spec(config_dir) == from_child


def test_a_lookup_waits_for_the_child_instead_of_building_again(fixtures, empty_cache, monkeypatch):
    config_dir = default_config_dir(fixtures["qwen2-ws2"].checkpoint_dir)
    build = SpecBuild(config_dir)

    def built_here(*args, **kwargs):
        raise AssertionError("the spec was built in this process while the child built it")

    monkeypatch.setattr(model_spec, "_spec_fields", built_here)
    build.spec()

    assert build.process.wait(timeout=60) == 0, "the child built the spec"


def test_a_spec_already_cached_starts_no_child(fixtures, empty_cache):
    config_dir = default_config_dir(fixtures["qwen2-ws2"].checkpoint_dir)
    load_model_spec(config_dir)

    assert SpecBuild(config_dir).process is None


def test_a_spec_the_child_cannot_build_is_reported_with_the_config_file(tmp_path, empty_cache):
    config_dir = tmp_path / "huggingface"
    config_dir.mkdir()
    (config_dir / "config.json").write_text('{"model_type": "no-such-model"}')
    build = SpecBuild(config_dir)

    with pytest.raises(CheckpointError, match=r"config\.json"):
        build.spec()

    assert build.process.returncode != 0
    assert not stored(config_dir)


def test_the_spec_build_starts_without_importing_torch():
    check = "import sys, mergeflow.spec.build; sys.exit('torch' in sys.modules)"

    assert subprocess.run([sys.executable, "-c", check], check=False).returncode == 0


def niceness_after_yielding(checkpoint_dir, target_dir) -> int:
    """The CPU niceness of a fresh process (this one's environment) after `yield_to_spec_build`, less its own
    niceness before."""
    script = (
        "import os, sys\n"
        "from mergeflow.job import MergeJob\n"
        "from mergeflow.write_ahead import yield_to_spec_build\n"
        "before = os.nice(0)\n"
        "yield_to_spec_build(MergeJob(sys.argv[1], sys.argv[2]))\n"
        "print(os.nice(0) - before)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(checkpoint_dir), str(target_dir)],
                          capture_output=True, text=True, check=True, timeout=CHILD_SECONDS)  # fmt: skip
    return int(done.stdout)


def test_the_command_yields_the_cpu_to_a_new_configs_spec_build(fixtures, empty_cache, tmp_path):
    assert niceness_after_yielding(fixtures["qwen2-ws2"].checkpoint_dir, tmp_path / "out") > 0


def test_the_command_keeps_its_priority_for_a_config_already_seen(fixtures, empty_cache, tmp_path):
    load_model_spec(default_config_dir(fixtures["qwen2-ws2"].checkpoint_dir))

    assert niceness_after_yielding(fixtures["qwen2-ws2"].checkpoint_dir, tmp_path / "out") == 0
