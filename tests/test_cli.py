"""The `mergeflow` command accepts verl's flags and reports on checkpoints."""

import gc
import json
import os

import pytest

from mergeflow.cli import build_parser, main
from mergeflow.options import MergeOptions
from mergeflow.spec import cache as spec_cache
from tests.merging import load_weights


@pytest.mark.parametrize(
    "argv",
    [
        [
            "merge",
            "--backend",
            "fsdp",
            "--local_dir",
            "D",
            "--target_dir",
            "T",
            "--tie-word-embedding",
            "--trust-remote-code",
            "--is-value-model",
            "--use_cpu_initialization",
            "--hf_model_config_path",
            "H",
        ],
        [
            "merge",
            "--backend",
            "fsdp",
            "--local-dir",
            "D",
            "--target-dir",
            "T",
            "--tie_word_embedding",
            "--trust_remote_code",
            "--is_value_model",
            "--use-cpu-initialization",
            "--hf-model-config-path",
            "H",
        ],
    ],
)
def test_verl_spellings_and_dash_forms_parse_alike(argv):
    args = build_parser().parse_args(argv)

    assert (args.local_dir, args.target_dir, args.hf_model_config_path) == ("D", "T", "H")
    assert args.tie_word_embedding and args.trust_remote_code and args.is_value_model


def test_deprecated_hf_model_path_means_the_config_path():
    args = build_parser().parse_args(["merge", "--local_dir", "D", "--hf_model_path", "H"])

    assert args.hf_model_config_path == "H"


def test_default_output_dtype_is_bf16_as_verl():
    assert build_parser().parse_args(["merge", "--local_dir", "D"]).dtype == "bf16"


@pytest.mark.usefixtures("prefect_server")
def test_merge_command_writes_the_model(fixtures, target_dir, capsys):
    code = main(
        [
            "merge",
            "--backend",
            "fsdp",
            "--local_dir",
            str(fixtures["qwen2-ws2"].checkpoint_dir),
            "--target_dir",
            str(target_dir),
            "--dtype",
            "fp32",
            "--no-progress",
        ]
    )

    assert code == 0
    assert "merged" in capsys.readouterr().out
    assert load_weights(target_dir)["model.norm.weight"].dtype.is_floating_point


@pytest.mark.usefixtures("prefect_server")
def test_a_merge_called_from_python_keeps_the_callers_cpu_priority(fixtures, target_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(spec_cache.CACHE_DIR_VARIABLE, str(tmp_path / "empty-spec-cache"))  # a new config's spec builds
    before = os.nice(0)

    code = main(["merge", "--local_dir", str(fixtures["qwen2-ws2"].checkpoint_dir), "--target_dir", str(target_dir), "--no-progress"])

    assert code == 0
    assert os.nice(0) == before


@pytest.mark.usefixtures("prefect_server")
def test_a_merge_called_from_python_leaves_the_callers_garbage_collector_as_it_was(fixtures, target_dir):
    frozen_before = gc.get_freeze_count()

    code = main(["merge", "--local_dir", str(fixtures["qwen2-ws2"].checkpoint_dir), "--target_dir", str(target_dir), "--no-progress"])

    assert code == 0
    assert gc.isenabled()
    assert gc.get_freeze_count() == frozen_before


@pytest.mark.usefixtures("prefect_server")
def test_merge_command_takes_the_config_from_hf_model_config_path(copy_checkpoint, target_dir):
    fixture = copy_checkpoint("qwen2-ws2")
    moved = fixture.run_dir / "hf-config"
    (fixture.checkpoint_dir / "huggingface").rename(moved)

    code = main(
        [
            "merge",
            "--local_dir",
            str(fixture.checkpoint_dir),
            "--target_dir",
            str(target_dir),
            "--hf_model_config_path",
            str(moved),
            "--no-progress",
        ]
    )

    assert code == 0
    assert (target_dir / "tokenizer.json").read_bytes() == (moved / "tokenizer.json").read_bytes()


def test_inspect_reports_mesh_placements_and_flags(fixtures, capsys):
    code = main(["inspect", str(fixtures["qwen2-hsdp-2x2"].checkpoint_dir), "--json"])
    report = json.loads(capsys.readouterr().out)

    assert code == 0
    assert report["world_size"] == 4
    assert report["mesh_shape"] == [2, 2]
    assert report["mesh_dim_names"] == ["ddp", "fsdp"]
    assert report["placements"] == {"replicate,shard:0": 27}
    assert report["dtypes"] == {"float32": 27}
    assert report["tied"] == {"lm_head.weight": "model.embed_tokens.weight"}
    assert report["lora"] is False
    assert report["value_model"] is False


def test_inspect_counts_parameters_once_for_tied_weights(fixtures, capsys):
    main(["inspect", str(fixtures["qwen2-ws2"].checkpoint_dir), "--json"])
    report = json.loads(capsys.readouterr().out)

    weights = load_weights(fixtures["qwen2-ws2"].reference_dir)
    assert report["num_parameters"] == sum(t.numel() for t in weights.values())


def test_inspect_flags_a_value_model(fixtures, capsys):
    main(["inspect", str(fixtures["value-ws2"].checkpoint_dir), "--json"])

    assert json.loads(capsys.readouterr().out)["value_model"] is True


def test_inspect_reports_lora_ranks_and_alpha(fixtures, capsys):
    main(["inspect", str(fixtures["lora-ws2"].checkpoint_dir), "--json"])
    report = json.loads(capsys.readouterr().out)

    assert report["lora"] is True
    assert report["lora_ranks"] == {"2": 2, "4": 5}  # v_proj ×2 at rank 2; q_proj, down_proj ×2 and embed_tokens at 4
    assert report["lora_alpha"] == 16
    assert report["lora_only"] is False


@pytest.mark.usefixtures("prefect_server")
def test_merge_command_folds_lora_with_merge_lora(fixtures, target_dir):
    code = main(
        [
            "merge",
            "--local_dir",
            str(fixtures["lora-ws2"].checkpoint_dir),
            "--target_dir",
            str(target_dir),
            "--merge-lora",
            "--no-progress",
        ]
    )

    assert code == 0
    assert not (target_dir / "lora_adapter").exists()
    assert not [key for key in load_weights(target_dir) if "lora_" in key]


@pytest.mark.usefixtures("prefect_server")
def test_merge_command_without_lora_alpha_exits_2_and_names_the_flag(fixtures, target_dir, capsys):
    code = main(["merge", "--local_dir", str(fixtures["lora-no-meta-fsdp1-ws2"].checkpoint_dir), "--target_dir", str(target_dir)])

    assert code == 2
    assert "--lora-alpha" in capsys.readouterr().err
    assert not target_dir.exists()


def test_inspect_of_a_bad_directory_exits_2(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    assert "not an FSDP checkpoint" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_server")
def test_demo_merges_a_fresh_fsdp2_checkpoint_and_matches_its_logits(tmp_path, capsys):
    assert main(["demo", "--workdir", str(tmp_path)]) == 0
    assert "logits of the merged model equal the original's (bf16): True" in capsys.readouterr().out
    assert (tmp_path / "merged" / "model.safetensors").exists()


@pytest.mark.parametrize("argv", [["serve", "--watch", "R"], ["sweep", "R"]], ids=["serve", "sweep"])
def test_automated_merges_take_drop_mtp(argv):
    assert build_parser().parse_args([*argv, "--output", "O", "--drop-mtp"]).drop_mtp


def test_both_served_deployments_pass_drop_mtp_to_their_merges():
    from mergeflow.deployments.serve import ServeOptions, build_deployments

    served = ServeOptions(run_dirs=["/runs/a"], output_dir="/models", options=MergeOptions(drop_mtp=True))

    deployments = build_deployments(served)

    assert [deployment.parameters["options"]["drop_mtp"] for deployment in deployments] == [True, True]
