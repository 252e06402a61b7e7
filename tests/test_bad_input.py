"""Bad input: one clear error naming the file and the problem, exit code 2, and no target written."""

import json
import os

import pytest
import torch
import torch.distributed.tensor  # the rank files hold DTensors

from mergeflow.cli import EXIT_BAD_INPUT, main

pytestmark = pytest.mark.usefixtures("prefect_server")


def merge_cli(checkpoint_dir, target_dir, *extra) -> int:
    return main(
        [
            "merge",
            "--backend",
            "fsdp",
            "--local_dir",
            str(checkpoint_dir),
            "--target_dir",
            str(target_dir),
            "--no-progress",
            *extra,
        ]
    )


def assert_refused(capsys, exit_code, target_dir, *fragments):
    error = capsys.readouterr().err
    assert exit_code == EXIT_BAD_INPUT
    for fragment in fragments:
        assert fragment in error
    assert not target_dir.exists()


def test_missing_rank_file(copy_checkpoint, target_dir, capsys):
    checkpoint = copy_checkpoint("qwen2-ws2").checkpoint_dir
    (checkpoint / "model_world_size_2_rank_1.pt").unlink()

    code = merge_cli(checkpoint, target_dir)

    assert_refused(
        capsys,
        code,
        target_dir,
        "rank file missing",
        "model_world_size_2_rank_1.pt",
        "fsdp_config.json says world_size=2",
    )


def test_extra_rank_file(copy_checkpoint, target_dir, capsys):
    checkpoint = copy_checkpoint("qwen2-ws2").checkpoint_dir
    (checkpoint / "model_world_size_2_rank_2.pt").write_bytes(
        (checkpoint / "model_world_size_2_rank_1.pt").read_bytes()
    )

    code = merge_cli(checkpoint, target_dir)

    assert_refused(capsys, code, target_dir, "unexpected rank file", "model_world_size_2_rank_2.pt")


def test_rank_files_of_another_world_size(copy_checkpoint, target_dir, capsys):
    checkpoint = copy_checkpoint("qwen2-ws2").checkpoint_dir
    (checkpoint / "model_world_size_4_rank_0.pt").write_bytes(
        (checkpoint / "model_world_size_2_rank_0.pt").read_bytes()
    )

    code = merge_cli(checkpoint, target_dir)

    assert_refused(capsys, code, target_dir, "unexpected rank file", "model_world_size_4_rank_0.pt")


def test_rank_files_of_several_world_sizes_without_fsdp_config(copy_checkpoint, target_dir, capsys):
    checkpoint = copy_checkpoint("qwen2-ws2").checkpoint_dir
    (checkpoint / "fsdp_config.json").unlink()
    (checkpoint / "model_world_size_1_rank_0.pt").write_bytes(
        (checkpoint / "model_world_size_2_rank_0.pt").read_bytes()
    )

    code = merge_cli(checkpoint, target_dir)

    assert_refused(capsys, code, target_dir, "several world sizes (1, 2)")


def test_world_size_is_read_from_file_names_without_fsdp_config(copy_checkpoint, target_dir):
    checkpoint = copy_checkpoint("qwen2-ws2").checkpoint_dir
    (checkpoint / "fsdp_config.json").unlink()

    assert merge_cli(checkpoint, target_dir) == 0


def test_truncated_shard(copy_checkpoint, target_dir, capsys):
    checkpoint = copy_checkpoint("qwen2-ws2").checkpoint_dir
    shard = checkpoint / "model_world_size_2_rank_1.pt"
    os.truncate(shard, shard.stat().st_size // 2)

    code = merge_cli(checkpoint, target_dir)

    assert_refused(capsys, code, target_dir, "not a torch checkpoint", str(shard), "truncated")


def test_shard_that_is_not_a_torch_file(copy_checkpoint, target_dir, capsys):
    checkpoint = copy_checkpoint("qwen2-ws2").checkpoint_dir
    shard = checkpoint / "model_world_size_2_rank_0.pt"
    shard.write_text("not a checkpoint\n")

    code = merge_cli(checkpoint, target_dir)

    assert_refused(capsys, code, target_dir, "not a torch checkpoint", str(shard))


def test_run_root_instead_of_a_checkpoint_names_the_path_to_use(copy_checkpoint, target_dir, capsys):
    fixture = copy_checkpoint("qwen2-ws2")

    code = merge_cli(fixture.run_dir, target_dir)

    assert_refused(
        capsys, code, target_dir, "not an FSDP checkpoint", str(fixture.run_dir / "global_step_1" / "actor")
    )


def test_global_step_dir_instead_of_actor_names_the_path_to_use(copy_checkpoint, target_dir, capsys):
    fixture = copy_checkpoint("qwen2-ws2")

    code = merge_cli(fixture.checkpoint_dir.parent, target_dir)

    assert_refused(capsys, code, target_dir, "pass the role directory instead", str(fixture.checkpoint_dir))


def test_missing_huggingface_config(copy_checkpoint, target_dir, capsys):
    checkpoint = copy_checkpoint("qwen2-ws2").checkpoint_dir
    (checkpoint / "huggingface" / "config.json").unlink()

    code = merge_cli(checkpoint, target_dir)

    assert_refused(
        capsys,
        code,
        target_dir,
        "missing",
        str(checkpoint / "huggingface" / "config.json"),
        "--hf_model_config_path",
    )


def test_shards_whose_shapes_disagree_with_the_config(copy_checkpoint, target_dir, capsys):
    checkpoint = copy_checkpoint("qwen2-ws2").checkpoint_dir
    config_path = checkpoint / "huggingface" / "config.json"
    config = json.loads(config_path.read_text())
    config["intermediate_size"] = 48
    config_path.write_text(json.dumps(config))

    code = merge_cli(checkpoint, target_dir)

    assert_refused(
        capsys,
        code,
        target_dir,
        "shape mismatch",
        "model.layers.0.mlp.gate_proj.weight: got (44, 24), expected (48, 24)",
    )


class _Payload:
    """Unpickling this would create a marker file: the test checks that it never happens."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_that_needs_arbitrary_globals_is_refused_and_never_executed(
    copy_checkpoint, target_dir, capsys, tmp_path
):
    checkpoint = copy_checkpoint("qwen2-ws2").checkpoint_dir
    marker = tmp_path / "code-was-executed"
    shard = checkpoint / "model_world_size_2_rank_1.pt"
    torch.save({"model.norm.weight": torch.ones(3), "payload": _Payload(marker)}, shard)

    code = merge_cli(checkpoint, target_dir)

    assert_refused(capsys, code, target_dir, "refusing to load", str(shard), "weights_only=True")
    assert not marker.exists()


def test_rank_files_that_disagree_on_keys(copy_checkpoint, target_dir, capsys):
    checkpoint = copy_checkpoint("qwen2-ws2").checkpoint_dir
    shard = checkpoint / "model_world_size_2_rank_1.pt"
    state = torch.load(shard, weights_only=True)
    del state["model.norm.weight"]
    torch.save(state, shard)

    code = merge_cli(checkpoint, target_dir)

    assert_refused(capsys, code, target_dir, "disagree on keys", str(shard), '"model.norm.weight"')


def test_rank_file_of_plain_tensors_among_dtensor_ranks(copy_checkpoint, target_dir, capsys):
    checkpoint = copy_checkpoint("qwen2-ws2").checkpoint_dir
    shard = checkpoint / "model_world_size_2_rank_1.pt"
    state = torch.load(shard, weights_only=True)
    torch.save({name: tensor.to_local() for name, tensor in state.items()}, shard)

    code = merge_cli(checkpoint, target_dir)

    assert_refused(capsys, code, target_dir, str(shard), "holds no DTensors")
