"""VeOmni checkpoints (verl's VeOmni engine: FSDP2 on VeOmni's meshes, saved by verl's FSDP checkpoint manager) merge
as FSDP ones do; under expert parallelism every expert comes from the rank files of the group that holds it."""

import shutil

import pytest
import torch

from mergeflow.errors import CheckpointError
from mergeflow.formats.fsdp.expert_split import ExpertSplit, expert_split
from mergeflow.formats.fsdp.layout import RankFiles
from mergeflow.formats.fsdp.rank_pickle import MeshPosition
from mergeflow.job import MergeJob
from tests.conftest import VEOMNI_FIXTURE_SPECS, VEOMNI_HF_MODEL_SPEC
from tests.merging import load_weights, logits, merge_with_engine

pytestmark = pytest.mark.slow

VEOMNI_FIXTURE_NAMES = [spec.name for spec in VEOMNI_FIXTURE_SPECS]
EXPERT_MESH = ("ep_fsdp",)


@pytest.fixture(scope="module")
def merged(veomni_fixtures, tmp_path_factory):
    """Each fixture of rank files merged once in float32 (`keep`), by the engine."""
    root = tmp_path_factory.mktemp("veomni-merged")
    return {
        name: merge_with_engine(veomni_fixtures[name].checkpoint_dir, root / name, dtype="keep").folder
        for name in VEOMNI_FIXTURE_NAMES
    }


@pytest.mark.parametrize("name", VEOMNI_FIXTURE_NAMES)
def test_merged_tensors_equal_the_original_state_dict(veomni_fixtures, merged, name):
    reference = load_weights(veomni_fixtures[name].reference_dir)
    output = load_weights(merged[name])

    assert output.keys() == reference.keys()
    for key, tensor in reference.items():
        assert torch.equal(output[key], tensor), key


@pytest.mark.parametrize("name", VEOMNI_FIXTURE_NAMES)
def test_merged_model_gives_the_original_logits(veomni_fixtures, merged, name):
    expected = logits(veomni_fixtures[name].reference_dir, torch.float32)

    assert torch.equal(logits(merged[name], torch.float32), expected)


@pytest.mark.parametrize("name", VEOMNI_FIXTURE_NAMES)
def test_the_expert_parallel_size_is_read_from_the_checkpoint(veomni_fixtures, name):
    fixture = veomni_fixtures[name]

    index = MergeJob(fixture.checkpoint_dir, fixture.checkpoint_dir.parent / "unused").index()

    assert index.facts()["expert_parallel"] == fixture.spec.expert_parallel


def test_a_missing_rank_file_is_an_error_naming_it(veomni_fixtures, tmp_path):
    run_dir = shutil.copytree(veomni_fixtures["veomni-qwen3moe-ep2-ws2"].run_dir, tmp_path / "run")
    checkpoint_dir = run_dir / "global_step_1" / "actor"
    (checkpoint_dir / "model_world_size_2_rank_1.pt").unlink()

    with pytest.raises(CheckpointError, match=r"rank file missing: .*model_world_size_2_rank_1\.pt"):
        merge_with_engine(checkpoint_dir, tmp_path / "merged")
    assert not (tmp_path / "merged").exists()


def positions(*coordinates: tuple[int, ...], shape: tuple[int, ...] = (1,)) -> list[MeshPosition]:
    return [MeshPosition(shape, EXPERT_MESH, coordinate) for coordinate in coordinates]


def rank_files(world_size: int) -> RankFiles:
    paths = tuple(f"/run/model_world_size_{world_size}_rank_{rank}.pt" for rank in range(world_size))
    return RankFiles("/run", world_size, paths, fsdp_version=2)


def test_the_groups_are_the_world_over_the_expert_mesh_with_ep_innermost():
    found = positions((0,), (0,), (1,), (1,), shape=(2,))

    split = expert_split(found[0], found, rank_files(4))

    assert split == ExpertSplit(2, (2,), EXPERT_MESH)
    assert [split.group_of(rank) for rank in range(4)] == [0, 1, 0, 1]
    assert split.offset(3, (2, 32, 24), (0, 16, 0)) == (2, 16, 0)


def test_under_hsdp_the_expert_mesh_is_replicas_of_fsdp_groups_with_ep_innermost():
    mesh = (2, 2)
    found = [
        MeshPosition(mesh, ("ep_replicate", "ep_fsdp"), (rank // 4, rank // 2 % 2)) for rank in range(8)
    ]

    split = expert_split(found[0], found, rank_files(8))

    assert split.size == 2
    assert [split.position_of(rank) for rank in range(8)] == [position.coordinate for position in found]


def test_a_rank_where_veomnis_layout_does_not_put_it_is_refused():
    found = positions((0,), (1,), (0,), (1,), shape=(2,))

    with pytest.raises(CheckpointError, match=r"rank_1\.pt sit at \(1,\).*cannot tell which experts it holds"):
        expert_split(found[0], found, rank_files(4))


def test_an_expert_mesh_that_does_not_divide_the_world_is_refused():
    found = positions((0,), (1,), (0,), shape=(2,))

    with pytest.raises(CheckpointError, match="does not divide the checkpoint's world_size=3"):
        expert_split(found[0], found, rank_files(3))


def test_experts_stacked_one_projection_per_tensor_merge_to_the_original(stacked_experts_fixture, tmp_path):
    output = merge_with_engine(stacked_experts_fixture.checkpoint_dir, tmp_path / "merged", dtype="keep").folder

    reference = load_weights(stacked_experts_fixture.reference_dir)
    merged = load_weights(output)
    assert merged.keys() == reference.keys()
    assert all(torch.equal(merged[key], tensor) for key, tensor in reference.items())
    assert torch.equal(logits(output, torch.float32), logits(stacked_experts_fixture.reference_dir, torch.float32))


def test_an_hf_model_only_save_by_verls_manager_is_copied_and_names_its_backend(veomni_fixtures, tmp_path):
    fixture = veomni_fixtures[VEOMNI_HF_MODEL_SPEC.name]

    with pytest.raises(CheckpointError, match="not an FSDP checkpoint") as refused:
        merge_with_engine(fixture.checkpoint_dir, tmp_path / "as-fsdp")
    output = merge_with_engine(fixture.checkpoint_dir, tmp_path / "merged", backend="hf").folder

    assert refused.value.hint.endswith("pass --backend hf")
    reference = load_weights(fixture.reference_dir)
    merged = load_weights(output)
    assert merged.keys() == reference.keys()
    assert all(torch.equal(merged[key], tensor) for key, tensor in reference.items())
