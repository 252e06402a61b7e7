"""Validation: completeness of a merged folder, and tensor-by-tensor comparison with a reference."""

import json
import os
import shutil
import time

import pytest
import torch
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mergeflow.cli import EXIT_VALIDATION_FAILED, main
from mergeflow.flows.merge import merge_checkpoint
from mergeflow.options import MergeOptions, Reference
from mergeflow.tasks.publish import artifact_key
from mergeflow.validation.validate import validate_model_dir
from tests.merging import merge_with_engine
from tests.prefect_runs import API_WAIT_SECONDS

CHECKPOINT = "llama-untied-ws3"


@pytest.fixture(scope="module")
def merged_dir(fixtures, tmp_path_factory):
    """The checkpoint merged in its own dtype (fp32), split over several files."""
    target = tmp_path_factory.mktemp("validation") / "merged"
    merge_with_engine(fixtures[CHECKPOINT].checkpoint_dir, target, dtype="keep", max_shard_size="10KB")
    return target


def edited_reference(fixtures, tmp_path, edit):
    """A copy of the original model with its tensors passed through `edit(dict) -> dict`."""
    reference = tmp_path / "reference"
    shutil.copytree(fixtures[CHECKPOINT].reference_dir, reference)
    tensors = edit(load_file(reference / "model.safetensors"))
    save_file(tensors, reference / "model.safetensors", metadata={"format": "pt"})
    return reference


def test_correct_merge_passes(fixtures, merged_dir):
    report = validate_model_dir(merged_dir, reference_dir=fixtures[CHECKPOINT].reference_dir)

    assert report.passed, report.problems
    assert report.tensors_compared == len(load_file(fixtures[CHECKPOINT].reference_dir / "model.safetensors"))


def test_one_perturbed_tensor_fails_naming_it(fixtures, merged_dir, tmp_path):
    def perturb(tensors):
        tensors["model.layers.1.mlp.up_proj.weight"][3, 5] += 0.25
        return tensors

    report = validate_model_dir(merged_dir, reference_dir=edited_reference(fixtures, tmp_path, perturb))

    assert not report.passed
    assert report.problems == (
        "value mismatch for model.layers.1.mlp.up_proj.weight: 1 element(s) differ, max |diff| 0.25",
    )
    assert report.largest_differences[0].name == "model.layers.1.mlp.up_proj.weight"


def test_missing_key_fails_naming_it(fixtures, merged_dir, tmp_path):
    def add(tensors):
        return {**tensors, "model.layers.0.extra.weight": torch.zeros(2)}

    report = validate_model_dir(merged_dir, reference_dir=edited_reference(fixtures, tmp_path, add))

    assert report.problems == ('missing key(s) "model.layers.0.extra.weight"',)


def test_extra_key_fails_naming_it(fixtures, merged_dir, tmp_path):
    def remove(tensors):
        del tensors["model.norm.weight"]
        return tensors

    report = validate_model_dir(merged_dir, reference_dir=edited_reference(fixtures, tmp_path, remove))

    assert report.problems == ('extra key(s) "model.norm.weight"',)


def test_shape_mismatch_fails_naming_the_key(fixtures, merged_dir, tmp_path):
    def reshape(tensors):
        tensors["model.norm.weight"] = torch.zeros(25)
        return tensors

    report = validate_model_dir(merged_dir, reference_dir=edited_reference(fixtures, tmp_path, reshape))

    assert report.problems == ("shape mismatch for model.norm.weight: got (24,), expected (25,)",)


def test_a_non_floating_dtype_mismatch_fails_naming_the_key(fixtures, merged_dir, tmp_path):
    def cast(tensors):
        tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int32)
        return tensors

    report = validate_model_dir(merged_dir, reference_dir=edited_reference(fixtures, tmp_path, cast))

    assert report.problems == ("dtype mismatch for model.norm.weight: got float32, expected int32",)


def test_a_reference_in_another_floating_dtype_is_compared_cast_to_the_merged_dtype(fixtures, tmp_path):
    bf16_merge = tmp_path / "bf16"
    merge_with_engine(fixtures[CHECKPOINT].checkpoint_dir, bf16_merge, dtype="bf16")

    report = validate_model_dir(bf16_merge, reference_dir=fixtures[CHECKPOINT].reference_dir)

    assert report.passed, report.failure_message()
    assert report.reference_casts == ("float32 -> bfloat16",)
    assert "reference cast float32 -> bfloat16" in report.verdict()


def test_a_reference_in_another_floating_dtype_still_fails_on_other_values(fixtures, tmp_path):
    def perturb(tensors):
        tensors["model.norm.weight"][0] += 1.0
        return tensors

    bf16_merge = tmp_path / "bf16"
    merge_with_engine(fixtures[CHECKPOINT].checkpoint_dir, bf16_merge, dtype="bf16")

    report = validate_model_dir(bf16_merge, reference_dir=edited_reference(fixtures, tmp_path, perturb))

    assert [problem.split(":")[0] for problem in report.problems] == ["value mismatch for model.norm.weight"]


def test_tolerances_accept_small_differences(fixtures, merged_dir, tmp_path):
    def nudge(tensors):
        tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1e-7
        return tensors

    reference = edited_reference(fixtures, tmp_path, nudge)

    assert not validate_model_dir(merged_dir, reference_dir=reference).passed
    assert validate_model_dir(merged_dir, reference_dir=reference, atol=1e-6).passed


def test_sharded_reference_works(fixtures, merged_dir, tmp_path):
    reference = tmp_path / "sharded-reference"
    merge_with_engine(fixtures[CHECKPOINT].checkpoint_dir, reference, dtype="keep", max_shard_size="4KB")

    assert validate_model_dir(merged_dir, reference_dir=reference).passed


def test_bin_reference_works(fixtures, merged_dir, tmp_path):
    reference = tmp_path / "bin-reference"
    reference.mkdir()
    torch.save(
        load_file(fixtures[CHECKPOINT].reference_dir / "model.safetensors"), reference / "pytorch_model.bin"
    )

    assert validate_model_dir(merged_dir, reference_dir=reference).passed


def test_reference_holding_a_tied_alias_still_matches(fixtures, tmp_path):
    merged = tmp_path / "merged"
    merge_with_engine(fixtures["qwen2-ws2"].checkpoint_dir, merged, dtype="keep")
    reference = tmp_path / "reference"
    shutil.copytree(fixtures["qwen2-ws2"].reference_dir, reference)
    tensors = load_file(reference / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, reference / "model.safetensors", metadata={"format": "pt"})

    assert validate_model_dir(merged, reference_dir=reference).passed


def test_logits_are_compared_on_request(fixtures, merged_dir):
    report = validate_model_dir(
        merged_dir, reference_dir=fixtures[CHECKPOINT].reference_dir, check_logits=True
    )

    assert report.logits.compared and report.logits.passed
    assert report.logits.max_abs_diff == 0.0


def sharded_copy(merged_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(merged_dir, copy)
    return copy, sorted(copy.glob("model-*.safetensors"))


def test_deleted_shard_fails_completeness(merged_dir, tmp_path):
    copy, shards = sharded_copy(merged_dir, tmp_path)
    shards[1].unlink()

    report = validate_model_dir(copy)

    assert report.problems == (f"missing weights file {shards[1]}",)


def test_truncated_shard_fails_completeness(merged_dir, tmp_path):
    copy, shards = sharded_copy(merged_dir, tmp_path)
    os.truncate(shards[0], shards[0].stat().st_size - 10)

    (problem,) = validate_model_dir(copy).problems

    assert problem.startswith(f"truncated or padded safetensors file: {shards[0]}")


def test_empty_shard_fails_completeness(merged_dir, tmp_path):
    copy, shards = sharded_copy(merged_dir, tmp_path)
    shards[0].write_bytes(b"")

    (problem,) = validate_model_dir(copy).problems

    assert problem.startswith(f"not a valid safetensors file: {shards[0]}")


def test_stray_shard_fails_completeness(merged_dir, tmp_path):
    copy, shards = sharded_copy(merged_dir, tmp_path)
    shutil.copy(shards[0], copy / "model-00099-of-00099.safetensors")

    assert validate_model_dir(copy).problems == (
        "stray weights file(s) not in model.safetensors.index.json: model-00099-of-00099.safetensors",
    )


def test_index_listing_a_tensor_its_file_lacks_fails_completeness(merged_dir, tmp_path):
    copy, _ = sharded_copy(merged_dir, tmp_path)
    index_path = copy / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.ghost.weight"] = index["weight_map"]["model.norm.weight"]
    index_path.write_text(json.dumps(index))

    (problem,) = validate_model_dir(copy).problems

    assert "lacks tensor(s) the index assigns it: model.ghost.weight" in problem


def test_config_and_tokenizer_alone_fail_completeness(merged_dir, tmp_path):
    copy, shards = sharded_copy(merged_dir, tmp_path)
    for path in [*shards, copy / "model.safetensors.index.json"]:
        path.unlink()

    (problem,) = validate_model_dir(copy).problems

    assert problem.startswith("no weights:")


@pytest.mark.usefixtures("prefect_server")
class TestCommands:
    def test_test_command_compares_straight_from_the_checkpoint(self, fixtures, capsys):
        code = main(
            [
                "test",
                "--backend",
                "fsdp",
                "--local_dir",
                str(fixtures[CHECKPOINT].checkpoint_dir),
                "--test_hf_dir",
                str(fixtures[CHECKPOINT].reference_dir),
            ]
        )

        assert code == 0
        assert "tensors equal" in capsys.readouterr().out

    def test_test_command_exits_1_naming_the_perturbed_tensor(self, fixtures, tmp_path, capsys):
        def perturb(tensors):
            tensors["model.embed_tokens.weight"][0, 0] += 1.0
            return tensors

        reference = edited_reference(fixtures, tmp_path, perturb)

        code = main(
            ["test", "--local_dir", str(fixtures[CHECKPOINT].checkpoint_dir), "--test_hf_dir", str(reference)]
        )

        assert code == EXIT_VALIDATION_FAILED
        assert "value mismatch for model.embed_tokens.weight: 1 element(s) differ, max |diff| 1" in (
            capsys.readouterr().err
        )

    def test_test_flow_compares_each_weight_file_in_a_task_run_of_its_own(self, fixtures):
        from mergeflow.flows.verify import verify_checkpoint
        from mergeflow.job import MergeJob
        from mergeflow.validation.validate import reference_dtype_choice
        from tests.prefect_runs import task_runs_of

        options = MergeOptions(max_shard_size="10KB", dtype=reference_dtype_choice(fixtures[CHECKPOINT].reference_dir))
        weight_files = list(MergeJob(fixtures[CHECKPOINT].checkpoint_dir, None, options).merge_plan()[0].shard_to_names)
        state = verify_checkpoint(
            local_dir=str(fixtures[CHECKPOINT].checkpoint_dir),
            reference=Reference(str(fixtures[CHECKPOINT].reference_dir)),
            options=options,
            return_state=True,
        )
        report = state.result()
        runs = task_runs_of(state.state_details.flow_run_id, count=len(weight_files) + 1, named="compare ")

        assert report.passed
        assert report.tensors_compared == len(torch_names(fixtures[CHECKPOINT].reference_dir))
        assert len(weight_files) > 1
        assert sorted(run.name for run in runs) == sorted(["compare key sets", *(f"compare {name}" for name in weight_files)])

    def test_a_mismatch_in_one_weight_file_fails_the_split_comparison(self, fixtures, tmp_path):
        from mergeflow.errors import ValidationError
        from mergeflow.flows.verify import verify_checkpoint

        def perturb(tensors):
            tensors["model.norm.weight"][0] += 1.0
            return tensors

        reference = edited_reference(fixtures, tmp_path, perturb)

        with pytest.raises(ValidationError, match=r"value mismatch for model\.norm\.weight: 1 element"):
            verify_checkpoint(
                local_dir=str(fixtures[CHECKPOINT].checkpoint_dir),
                reference=Reference(str(reference)),
                options=MergeOptions(max_shard_size="10KB"),
            )

    def test_test_command_takes_a_task_runner(self, fixtures):
        argv = ["test", "--local_dir", str(fixtures[CHECKPOINT].checkpoint_dir), "--test_hf_dir", str(fixtures[CHECKPOINT].reference_dir)]

        assert main([*argv, "--task-runner", "threads:4"]) == 0

    def test_test_command_casts_to_the_references_dtype(self, fixtures, tmp_path):
        reference = tmp_path / "bf16-reference"
        merge_with_engine(fixtures[CHECKPOINT].checkpoint_dir, reference, dtype="bf16")

        assert (
            main(
                [
                    "test",
                    "--local_dir",
                    str(fixtures[CHECKPOINT].checkpoint_dir),
                    "--test_hf_dir",
                    str(reference),
                ]
            )
            == 0
        )

    def test_validate_command_checks_a_copied_folder(self, merged_dir, fixtures):
        assert (
            main(["validate", str(merged_dir), "--test_hf_dir", str(fixtures[CHECKPOINT].reference_dir)]) == 0
        )

    def test_validate_command_exits_1_on_an_incomplete_folder(self, merged_dir, tmp_path, capsys):
        copy, shards = sharded_copy(merged_dir, tmp_path)
        shards[0].unlink()

        assert main(["validate", str(copy)]) == EXIT_VALIDATION_FAILED
        assert f"missing weights file {shards[0]}" in capsys.readouterr().err

    def test_merge_publishes_summary_and_difference_artifacts(self, fixtures, target_dir):
        checkpoint = str(fixtures[CHECKPOINT].checkpoint_dir)
        state = merge_checkpoint(
            local_dir=checkpoint,
            target_dir=str(target_dir),
            options=MergeOptions(dtype="keep"),
            reference=Reference(str(fixtures[CHECKPOINT].reference_dir)),
            progress=False,
            return_state=True,
        )

        keys = [artifact_key(kind, checkpoint, str(target_dir)) for kind in ("merge-summary", "merge-differences")]
        by_key = artifacts_by_key(keys, flow_run_id=state.state_details.flow_run_id)

        assert set(by_key) == set(keys)
        assert "| validation | passed |" in by_key[keys[0]].data
        assert "| world size | 3 |" in by_key[keys[0]].data
        assert f"| output | `{target_dir.absolute()}` |" in by_key[keys[0]].data
        assert ".mergeflow-staging" not in by_key[keys[0]].data


def artifacts_by_key(keys: list[str], *, flow_run_id) -> dict:
    """One flow run's artifacts with these keys, once the API has them all (within a bound: writes may lag).

    Other runs on the same checkpoint publish under the same keys: that is what makes them comparable.
    """
    deadline = time.monotonic() + API_WAIT_SECONDS
    artifact_filter = ArtifactFilter(
        key=ArtifactFilterKey(any_=keys), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])
    )
    while True:
        with get_client(sync_client=True) as client:
            artifacts = client.read_artifacts(artifact_filter=artifact_filter)
        by_key = {artifact.key: artifact for artifact in artifacts}
        if set(by_key) == set(keys) or time.monotonic() > deadline:
            return by_key
        time.sleep(0.5)


def test_artifact_keys_are_stable_per_checkpoint_and_target_and_valid():
    key = artifact_key("merge-summary", "/runs/Run_A/global_step_120/actor", "/models/a")

    assert key == artifact_key("merge-summary", "/runs/Run_A/global_step_120/actor", "/models/a")
    assert key.startswith("merge-summary-run-a-global-step-120-actor-")
    assert key != artifact_key("merge-summary", "/other/Run_A/global_step_120/actor", "/models/a")


def test_merges_of_one_checkpoint_into_two_targets_keep_an_artifact_each():
    checkpoint = "/runs/Run_A/global_step_120/actor"

    assert artifact_key("merge-summary", checkpoint, "/models/a") != artifact_key("merge-summary", checkpoint, "/models/b")


def torch_names(model_dir) -> set[str]:
    """The tensor names of a model folder's safetensors files, tied aliases included."""
    names = set()
    for path in model_dir.glob("*.safetensors"):
        with safe_open(path, framework="pt") as tensors:
            names.update(tensors.keys())
    return names
