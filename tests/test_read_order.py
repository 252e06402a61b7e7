"""A merge reads ahead in the order it reads: once planned, a running read-ahead goes on over the byte ranges of
each tensor's rank blocks, in the order the weight files are written."""

import pytest
import torch

from mergeflow import job as job_module
from mergeflow.job import MergeJob
from mergeflow.output.save import sources_in_write_order
from mergeflow.perf import read_ahead as read_ahead_module
from mergeflow.perf.read_ahead import ReadAhead


def storage_bytes(tensor: torch.Tensor) -> bytes:
    """Every byte of the storage a tensor views (what torch.save writes as its record)."""
    return torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage()).numpy().tobytes()


@pytest.mark.parametrize("name", ["qwen2-ws2", "qwen2-fsdp1-ws3", "qwen2-hsdp-2x2"])
def test_a_tensors_byte_ranges_hold_the_data_of_each_rank_holding_it(fixtures, name, tmp_path):
    index = MergeJob(fixtures[name].checkpoint_dir, tmp_path / "merged").index()
    tensor_name = next(name for name in index.tensors if name.endswith("mlp.up_proj.weight"))

    ranges = index.byte_ranges([tensor_name])

    assert len(ranges) == len(index.tensors[tensor_name].blocks)
    for path, offset, length in ranges:
        local = torch.load(path, map_location="cpu", mmap=True, weights_only=True)[tensor_name]
        local = local.to_local() if hasattr(local, "to_local") else local
        with open(path, "rb") as file:
            file.seek(offset)
            assert file.read(length) == storage_bytes(local)


@pytest.fixture
def stored_spec(fixtures, tmp_path) -> None:
    """The spec of qwen2-ws2 in the cache (a job whose spec is not stored reads ahead while it builds it)."""
    job = MergeJob(fixtures["qwen2-ws2"].checkpoint_dir, tmp_path / "first")
    job.spec()
    job.close()


@pytest.fixture
def created_read_aheads(monkeypatch) -> list[ReadAhead]:
    """Every ReadAhead a job creates from here on; each reads nothing and runs until stopped."""
    created: list[ReadAhead] = []
    monkeypatch.setattr(read_ahead_module, "_read_ahead", lambda ranges, budget, stop: stop.wait())

    class Recorded(ReadAhead):
        def __init__(self, ranges):
            super().__init__(ranges)
            created.append(self)

    monkeypatch.setattr(job_module, "ReadAhead", Recorded)
    yield created
    for reading in created:
        reading.stop()


def test_a_running_read_ahead_goes_on_in_the_order_the_weight_files_are_written(
    fixtures, stored_spec, created_read_aheads, tmp_path
):
    job = MergeJob(fixtures["qwen2-ws2"].checkpoint_dir, tmp_path / "merged")
    job.start_read_ahead(job.layout().data_files)

    plan, _ = job.merge_plan()

    whole_files, in_plan_order = created_read_aheads
    assert not whole_files.running
    assert in_plan_order.ranges == tuple(job.index().byte_ranges(sources_in_write_order(plan)))


def test_a_job_that_was_not_reading_ahead_does_not_start_once_planned(
    fixtures, stored_spec, created_read_aheads, tmp_path
):
    MergeJob(fixtures["qwen2-ws2"].checkpoint_dir, tmp_path / "merged").merge_plan()

    assert created_read_aheads == []


def test_the_write_order_reads_every_planned_tensor_once(fixtures, tmp_path):
    plan, _ = MergeJob(fixtures["qwen2-ws2"].checkpoint_dir, tmp_path / "merged").merge_plan()

    assert sorted(sources_in_write_order(plan)) == sorted(tensor.source for tensor in plan.tensors.values())
