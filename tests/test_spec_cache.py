"""Model specs remembered across merges: same fields as a fresh build, keyed by the config, no transformers."""

import json
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from mergeflow.spec import cache as spec_cache
from mergeflow.spec.model_spec import load_model_spec


@pytest.fixture
def config_dir(fixtures, tmp_path):
    directory = tmp_path / "huggingface"
    shutil.copytree(fixtures["qwen2-ws2"].checkpoint_dir / "huggingface", directory)
    return directory


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(spec_cache.CACHE_DIR_VARIABLE, str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_spec_read_from_the_cache_equals_the_built_one(config_dir, empty_cache):
    built = load_model_spec(config_dir)

    cached = load_model_spec(config_dir)

    assert cached == built
    assert len(list((empty_cache / spec_cache.SPEC_SUBDIR).iterdir())) == 1


def test_cached_spec_is_read_without_importing_transformers(config_dir, empty_cache):
    load_model_spec(config_dir)
    script = (
        "import sys; from mergeflow.spec.model_spec import load_model_spec; "
        f"load_model_spec({str(config_dir)!r}); print('transformers' in sys.modules)"
    )

    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)

    assert result.stdout.strip() == "False"


def test_changed_config_is_built_again(config_dir, empty_cache):
    before = load_model_spec(config_dir)
    config = json.loads((config_dir / "config.json").read_text())
    config["intermediate_size"] += 8
    (config_dir / "config.json").write_text(json.dumps(config))

    after = load_model_spec(config_dir)

    name = "model.layers.0.mlp.up_proj.weight"
    assert after.expected_shapes[name][0] == before.expected_shapes[name][0] + 8


def test_value_model_option_is_part_of_the_key(config_dir, empty_cache):
    load_model_spec(config_dir)

    value = load_model_spec(config_dir, is_value_model=True)

    assert value.is_value_model and value.architecture.endswith("ForTokenClassification")


def test_unreadable_cache_entry_is_rebuilt(config_dir, empty_cache):
    built = load_model_spec(config_dir)
    (entry,) = (empty_cache / spec_cache.SPEC_SUBDIR).iterdir()
    entry.write_text("{not json")

    assert load_model_spec(config_dir) == built


def test_cache_entry_missing_a_field_is_rebuilt(config_dir, empty_cache):
    built = load_model_spec(config_dir)
    (entry,) = (empty_cache / spec_cache.SPEC_SUBDIR).iterdir()
    fields = json.loads(entry.read_text())
    del fields["tied"]
    entry.write_text(json.dumps(fields))

    assert load_model_spec(config_dir) == built


def test_concurrent_requests_for_one_spec_build_it_once(empty_cache):
    builds = []
    started = threading.Barrier(4)

    def build():
        builds.append(1)
        time.sleep(0.2)
        return {"field": 1}

    def request():
        started.wait()
        return spec_cache.cached_fields("one-key", build, required=("field",))

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: request(), range(4)))

    assert results == [{"field": 1}] * 4
    assert len(builds) == 1


def test_cached_spec_of_a_model_saved_per_expert_keeps_its_views(fixtures, tmp_path, empty_cache):
    config_dir = tmp_path / "moe"
    shutil.copytree(fixtures["qwen3moe-ws2"].checkpoint_dir / "huggingface", config_dir)
    built = load_model_spec(config_dir)

    cached = load_model_spec(config_dir)

    assert cached == built
    assert cached.saved_views and all(view.source in cached.expected_shapes for view in cached.saved_views.values())


def test_the_merge_flow_imports_without_transformers():
    script = "import sys; from flows.merge import merge_checkpoint; print('transformers' in sys.modules)"

    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)

    assert result.stdout.strip() == "False"
