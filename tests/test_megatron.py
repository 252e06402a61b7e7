"""Megatron `torch_dist` checkpoints, written by real megatron-core, merge into the original HF model.

Where no writer of a model's layout runs here, the fixture is derived from the writer's source and says so: Qwen3-VL
and Qwen3-VL-MoE are Megatron-Bridge's module tree rebuilt from megatron-core's layers (Megatron-Bridge needs Python
3.12), as is the Qwen3.5 vision tower (`tests.writers.megatron_qwen3_vl`); their archives are still megatron-core's.
"""

import dataclasses
import json
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint
from transformers import AutoConfig

import mergeflow.formats.dcp
from mergeflow.errors import CheckpointError, PlanError
from mergeflow.flows.merge import merge_checkpoint
from mergeflow.formats.megatron.contents import CONTENTS_FILE
from mergeflow.formats.megatron.families import FAMILIES
from mergeflow.formats.megatron.index import index_megatron
from mergeflow.formats.megatron.layout import find_megatron_checkpoint
from mergeflow.formats.registry import find_checkpoint
from mergeflow.options import MergeOptions, Reference
from mergeflow.spec.model_spec import load_model_spec
from mergeflow.validation.validate import validate_model_dir
from tests.conftest import MEGATRON_FIXTURE_NAMES, MEGATRON_FIXTURE_SPECS
from tests.merging import load_weights, logits, merge_with_engine, model_class, resaved_megatron_checkpoint
from tests.writers.megatron import LOGITS_INPUT_IDS

REPO_ROOT = Path(__file__).parent.parent
WITHOUT_PIPELINE = [spec.name for spec in MEGATRON_FIXTURE_SPECS if spec.pp == 1]
MOE = [
    spec.name
    for spec in MEGATRON_FIXTURE_SPECS
    if spec.model in ("qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe", "gpt_oss", "qwen3_vl_moe", "qwen3_5_moe", "qwen3_next")
]


@pytest.fixture(scope="session")
def merged_megatron(megatron_fixtures, tmp_path_factory):
    outputs: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in outputs:
            target = tmp_path_factory.mktemp("merged-megatron") / name
            merge_with_engine(megatron_fixtures[name].checkpoint_dir, target, backend="megatron", dtype="keep")
            outputs[name] = target
        return outputs[name]

    return get


@pytest.mark.parametrize("name", MEGATRON_FIXTURE_NAMES)
def test_merged_tensors_equal_the_original_model_bit_for_bit(megatron_fixtures, merged_megatron, name):
    report = validate_model_dir(merged_megatron(name), reference_dir=megatron_fixtures[name].reference_dir)

    assert report.passed, report.failure_message()
    assert report.tensors_compared == len(load_weights(megatron_fixtures[name].reference_dir))


@pytest.mark.parametrize("name", MEGATRON_FIXTURE_NAMES)
def test_merged_model_gives_the_original_logits(megatron_fixtures, merged_megatron, name):
    assert torch.equal(logits(merged_megatron(name), torch.float32), logits(megatron_fixtures[name].reference_dir, torch.float32))


@pytest.mark.parametrize("name", WITHOUT_PIPELINE)
def test_merged_model_gives_megatron_cores_own_logits(megatron_fixtures, merged_megatron, name):
    model = model_class(merged_megatron(name)).from_pretrained(merged_megatron(name), dtype=torch.float32).eval()
    with torch.no_grad():
        merged = model(torch.tensor(LOGITS_INPUT_IDS)).logits
    mcore = torch.load(megatron_fixtures[name].mcore_logits_file, weights_only=True)

    torch.testing.assert_close(merged, mcore, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", MOE)
def test_experts_are_written_one_tensor_each_under_the_names_save_pretrained_uses(megatron_fixtures, merged_megatron, name):
    assert load_weights(merged_megatron(name)).keys() == load_weights(megatron_fixtures[name].reference_dir).keys()


def test_qwen3_vl_moe_experts_are_written_input_major_as_its_checkpoints_hold_them(megatron_fixtures, merged_megatron):
    name = "megatron-qwen3vlmoe-tp2-ep2"
    text = AutoConfig.from_pretrained(megatron_fixtures[name].reference_dir).text_config
    merged = load_weights(merged_megatron(name))
    experts, hidden, ffn = text.num_experts, text.hidden_size, text.moe_intermediate_size

    assert merged["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (experts, hidden, 2 * ffn)
    assert merged["model.language_model.layers.0.mlp.experts.down_proj"].shape == (experts, ffn, hidden)


@pytest.fixture(scope="session")
def qwen3_vl_one_key_per_module(megatron_fixtures, tmp_path_factory):
    """The Qwen3-VL checkpoint with every stacked tensor saved one key per layer and per DeepStack merger, as
    Megatron-Bridge saves a model whose layers differ, by torch DCP's own writer."""
    fixture = megatron_fixtures["megatron-qwen3vl-tp2"]
    stacked = re.compile(r"^(.*\.(?:layers|deepstack_merger_list)\.)(?!\d)(.*)$")

    def one_key_per_module(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        unstacked = {}
        for key, value in state.items():
            match = stacked.match(key)
            unstacked |= {f"{match[1]}{i}.{match[2]}": one for i, one in enumerate(value)} if match else {key: value}
        return unstacked

    checkpoint_dir = tmp_path_factory.mktemp("one-key-per-module") / "global_step_1" / "actor"
    return fixture, resaved_megatron_checkpoint(fixture.model_dir, checkpoint_dir, one_key_per_module)


def test_layers_and_deepstack_mergers_saved_one_key_each_merge_as_stacked_ones_do(qwen3_vl_one_key_per_module, tmp_path):
    fixture, checkpoint_dir = qwen3_vl_one_key_per_module
    merge_with_engine(checkpoint_dir, tmp_path / "out", backend="megatron", dtype="keep")

    report = validate_model_dir(tmp_path / "out", reference_dir=fixture.reference_dir)

    assert report.passed, report.failure_message()
    assert report.tensors_compared == len(load_weights(fixture.reference_dir))


def test_tied_output_layer_is_not_written_and_untied_is(merged_megatron):
    assert "lm_head.weight" not in load_weights(merged_megatron("megatron-llama-tied-tp2"))
    assert "lm_head.weight" in load_weights(merged_megatron("megatron-qwen2-tp1"))


@pytest.fixture(scope="session")
def checkpoint_with_optimizer_state(megatron_fixtures, tmp_path_factory):
    """A 2025-layout checkpoint as verl wrote it with the optimizer in the same archive: every model tensor
    of a megatron-core fixture plus Adam moments under megatron-core's optimizer keys, saved by torch DCP's
    own writer (which also records the archive's path in the metadata)."""
    fixture = megatron_fixtures["megatron-qwen2-tp1"]

    def with_optimizer_state(model_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return model_state | {
            f"{prefix}optimizer.state.{moment}.{key}": torch.randn_like(value)
            for key, value in model_state.items()
            for moment in ("exp_avg", "exp_avg_sq")
            for prefix in ("", "chained_1.")
        }

    checkpoint_dir = tmp_path_factory.mktemp("with-optimizer") / "global_step_1" / "actor"
    return fixture, resaved_megatron_checkpoint(fixture.model_dir, checkpoint_dir, with_optimizer_state)


def test_optimizer_state_saved_with_the_model_is_left_out(checkpoint_with_optimizer_state, tmp_path):
    fixture, checkpoint_dir = checkpoint_with_optimizer_state
    merge_with_engine(checkpoint_dir, tmp_path / "out", backend="megatron", dtype="keep")

    report = validate_model_dir(tmp_path / "out", reference_dir=fixture.reference_dir)

    assert report.passed, report.failure_message()
    assert not [name for name in load_weights(tmp_path / "out") if "optimizer" in name or "exp_avg" in name]


@pytest.mark.usefixtures("prefect_server")
def test_merge_flow_runs_the_megatron_backend(megatron_fixtures, target_dir):
    fixture = megatron_fixtures["megatron-qwen2-tied-tp2-pp2"]

    saved = merge_checkpoint(
        local_dir=str(fixture.checkpoint_dir),
        target_dir=str(target_dir),
        options=MergeOptions(backend="megatron", dtype="keep"),
        reference=Reference(str(fixture.reference_dir)),
        progress=False,
    )

    assert model_class(target_dir).from_pretrained(target_dir) is not None
    assert (target_dir / "tokenizer.json").read_bytes() == (fixture.model_dir / "huggingface" / "tokenizer.json").read_bytes()
    assert saved.num_tensors == len(load_weights(fixture.reference_dir))


@pytest.mark.parametrize(
    ("fixture", "table", "template", "key"),
    [
        ("megatron-qwen2-tp1", "table", "decoder.layers.{layer}.mlp.linear_fc2.weight", "decoder.layers.mlp.linear_fc2.weight"),
        (
            "megatron-qwen2moe-ep2",
            "table",
            "decoder.layers.{layer}.mlp.shared_experts.gate_weight",
            "decoder.layers.1.mlp.shared_experts.gate_weight",
        ),
        ("megatron-qwen25vl-tp2", "vision", "patch_embed.proj.weight", "vision_model.patch_embed.proj.weight"),
        (
            "megatron-qwen3vl-tp2",
            "vision",
            "decoder.deepstack_merger_list.{index}.patch_norm.bias",
            "vision_model.decoder.deepstack_merger_list.patch_norm.bias",
        ),
    ],
    ids=["dense", "expert", "vision tower", "deepstack merger"],
)
def test_a_key_the_tables_do_not_know_is_an_error_that_names_it(megatron_fixtures, monkeypatch, fixture, table, template, key):
    layout = find_megatron_checkpoint(megatron_fixtures[fixture].checkpoint_dir)
    model_type = json.loads((Path(layout.hf_dir) / "config.json").read_text())["model_type"]
    monkeypatch.delitem(getattr(FAMILIES[model_type], table), template)

    with pytest.raises(PlanError, match=rf'unmapped key\(s\) for {model_type} .*"{re.escape(key)}"'):
        index_megatron(layout, load_model_spec(Path(layout.hf_dir)))


def test_an_expert_axis_longer_or_shorter_than_the_config_says_is_an_error(megatron_fixtures, tmp_path):
    layout = find_megatron_checkpoint(megatron_fixtures["megatron-qwen3moe-tp2"].checkpoint_dir)
    config = tmp_path / "config"
    shutil.copytree(layout.hf_dir, config)
    settings = json.loads((config / "config.json").read_text())
    settings["num_local_experts" if "num_local_experts" in settings else "num_experts"] = 8
    (config / "config.json").write_text(json.dumps(settings))

    with pytest.raises(PlanError, match=r"experts.linear_fc1.weight has shape \(2, 4, .*expected 2 layers x 8 experts first"):
        index_megatron(layout, load_model_spec(config))


def test_an_unknown_architecture_is_an_error_that_names_it(megatron_fixtures, tmp_path):
    layout = find_megatron_checkpoint(megatron_fixtures["megatron-qwen2-tp1"].checkpoint_dir)
    spec = load_model_spec(Path(layout.hf_dir))
    gpt2 = {**spec.config_values, "model_type": "gpt2"}

    with pytest.raises(PlanError, match='unknown architecture for the Megatron backend: model_type "gpt2"'):
        index_megatron(layout, dataclasses.replace(spec, config_values=gpt2))


def test_a_directory_without_dist_ckpt_is_an_error_that_says_which_to_pass(megatron_fixtures):
    step_dir = megatron_fixtures["megatron-qwen2-tp1"].checkpoint_dir.parent

    with pytest.raises(CheckpointError, match=r"not a Megatron checkpoint: .*: pass .*actor"):
        find_megatron_checkpoint(step_dir)


def test_a_megatron_checkpoint_merged_as_fsdp_says_which_backend_to_pass(megatron_fixtures):
    with pytest.raises(CheckpointError, match="not an FSDP checkpoint") as refused:
        find_checkpoint(megatron_fixtures["megatron-qwen2-tp1"].checkpoint_dir, "fsdp")

    assert refused.value.hint.endswith(": pass --backend megatron")


@pytest.mark.parametrize("wrapped_prefix", ["model.", "model.module."])
def test_a_megatron_fsdp_archive_is_refused_naming_it(megatron_fixtures, tmp_path, wrapped_prefix):
    fixture = megatron_fixtures["megatron-qwen2-tp1"]
    checkpoint_dir = resaved_megatron_checkpoint(
        fixture.model_dir,
        tmp_path / "run" / "global_step_1" / "actor",
        lambda state: {wrapped_prefix + key: value for key, value in state.items()},
    )

    with pytest.raises(CheckpointError, match=r"dist_ckpt is a Megatron-FSDP checkpoint .*which mergeflow does not read"):
        merge_with_engine(checkpoint_dir, tmp_path / "out", backend="megatron")
    assert not (tmp_path / "out").exists()


def test_metadata_that_asks_for_code_is_refused_without_running_it(tmp_path):
    class Exploit:
        def __reduce__(self):
            return (subprocess.call, (["touch", str(tmp_path / "pwned")],))

    archive = tmp_path / "dist_ckpt"
    archive.mkdir()
    (archive / ".metadata").write_bytes(pickle.dumps(Exploit()))

    with pytest.raises(CheckpointError, match=r"refusing to load global subprocess\.call"):
        mergeflow.formats.dcp.read_metadata(archive)
    assert not (tmp_path / "pwned").exists()


def test_the_engine_never_imports_megatron_core():
    code = (
        "import sys, mergeflow.cli, mergeflow.flows.merge, mergeflow.flows.verify, mergeflow.formats.megatron.index;"
        "print(sorted(m for m in ('megatron', 'mergeflow.demo') if m in sys.modules))"
    )

    imported = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)

    assert imported.stdout.strip() == "[]"
    sources = [p for folder in ("mergeflow", "tasks", "flows") for p in (REPO_ROOT / folder).rglob("*.py")]
    assert not [p for p in sources if "import megatron" in p.read_text() or "from megatron" in p.read_text()]


@pytest.fixture
def mbridge_checkpoint(megatron_fixtures, tmp_path):
    """A Megatron checkpoint as verl saves it with mbridge: the HF weights in `model/huggingface/`, no
    `dist_ckpt/`, and a manifest that says so."""
    fixture = megatron_fixtures["megatron-qwen2-tp1"]
    checkpoint_dir = tmp_path / "run" / "global_step_1" / "actor"
    shutil.copytree(fixture.checkpoint_dir, checkpoint_dir)
    model_dir = checkpoint_dir / fixture.model_dir.relative_to(fixture.checkpoint_dir)
    shutil.rmtree(model_dir / "dist_ckpt")
    for weights in fixture.reference_dir.glob("*.safetensors"):
        shutil.copyfile(weights, model_dir / "huggingface" / weights.name)
    manifest_path = checkpoint_dir / CONTENTS_FILE
    manifest = json.loads(manifest_path.read_text())
    manifest["backend"].update(has_bridge=True, use_dist_checkpointing=False)
    manifest["contents"]["model"] = {"path": "model/huggingface", "format": "huggingface", "backend": "mbridge"}
    manifest_path.write_text(json.dumps(manifest))
    return fixture, checkpoint_dir, model_dir / "huggingface"


@pytest.mark.usefixtures("prefect_server")
def test_huggingface_weights_already_saved_are_copied_byte_for_byte(mbridge_checkpoint, target_dir):
    _, checkpoint_dir, hf_dir = mbridge_checkpoint

    merge_checkpoint(
        local_dir=str(checkpoint_dir), target_dir=str(target_dir), options=MergeOptions(backend="megatron"), progress=False
    )

    copied = {path.name: path.read_bytes() for path in hf_dir.iterdir()}
    assert {name: (target_dir / name).read_bytes() for name in copied} == copied
    assert (target_dir / "README.md").is_file()


@pytest.mark.usefixtures("prefect_server")
def test_copied_model_is_validated_against_the_reference(mbridge_checkpoint, target_dir):
    fixture, checkpoint_dir, _ = mbridge_checkpoint

    saved = merge_checkpoint(
        local_dir=str(checkpoint_dir),
        target_dir=str(target_dir),
        options=MergeOptions(backend="megatron"),
        reference=Reference(str(fixture.reference_dir)),
        progress=False,
    )

    assert saved.num_tensors == len(load_weights(fixture.reference_dir))


def test_indexing_a_checkpoint_without_dist_ckpt_points_to_validate(mbridge_checkpoint):
    _, checkpoint_dir, hf_dir = mbridge_checkpoint
    layout = find_megatron_checkpoint(checkpoint_dir)

    with pytest.raises(CheckpointError, match=r"already holds the Hugging Face model .* `mergeflow validate"):
        index_megatron(layout, load_model_spec(hf_dir))
