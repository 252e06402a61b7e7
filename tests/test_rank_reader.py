"""Reading rank files: the pickle reader against torch.load, file offsets, direct reads, the mapping fallback."""

import ctypes
import mmap
import os

import pytest
import torch
from torch.distributed.tensor import DTensor

from mergeflow.formats.fsdp.index import load_rank_state
from mergeflow.formats.fsdp.placement import REPLICATE, shard
from mergeflow.formats.fsdp.rank_pickle import read_rank_pickle, tensor_file_offsets
from mergeflow.formats.fsdp.reader import RankReader
from mergeflow.perf.pages import in_page_cache, uncached_ranges


def evict(path) -> None:
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def torch_loaded(path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", mmap=True, weights_only=True)


def placement_names(tensor: DTensor) -> tuple[str, ...]:
    return tuple(shard(p.dim) if p.is_shard() else REPLICATE for p in tensor.placements)


@pytest.mark.parametrize(
    ("fixture", "rank_file"),
    [
        ("qwen2-ws2", "model_world_size_2_rank_1.pt"),
        ("qwen2-fsdp1-ws3", "model_world_size_3_rank_2.pt"),
        ("qwen2-hsdp-2x2", "model_world_size_4_rank_3.pt"),
        ("qwen2-ws1", "model_world_size_1_rank_0.pt"),
    ],
)
def test_pickle_reader_sees_what_torch_load_sees(fixtures, fixture, rank_file):
    path = fixtures[fixture].checkpoint_dir / rank_file
    expected = torch_loaded(path)

    state = read_rank_pickle(path)

    assert list(state) == list(expected)
    for name, tensor in expected.items():
        read = state[name]
        local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
        assert (read.shape, read.dtype) == (tuple(tensor.shape), tensor.dtype), name
        assert read.local.stride() == local.stride() and torch.equal(read.local, local), name
        if isinstance(tensor, DTensor):
            assert read.placements == placement_names(tensor), name
            assert read.mesh.shape == tuple(tensor.device_mesh.shape), name
            assert read.mesh.dim_names == tensor.device_mesh.mesh_dim_names, name
            assert read.mesh.coordinate == tuple(tensor.device_mesh.get_coordinate()), name
        else:
            assert read.placements is None and read.mesh is None, name


def test_pickle_reader_offsets_point_at_each_tensors_bytes(fixtures):
    path = fixtures["qwen2-ws2"].checkpoint_dir / "model_world_size_2_rank_1.pt"
    raw = path.read_bytes()

    state = read_rank_pickle(path)

    for name, tensor in state.items():
        nbytes = tensor.local.numel() * tensor.local.element_size()
        assert raw[tensor.file_offset : tensor.file_offset + nbytes] == tensor.local.numpy().tobytes(), name


def test_offsets_of_a_torch_loaded_state_point_at_each_tensors_bytes(fixtures):
    path = fixtures["qwen2-ws2"].checkpoint_dir / "model_world_size_2_rank_1.pt"
    locals_by_name = {name: t._local_tensor if isinstance(t, DTensor) else t for name, t in torch_loaded(path).items()}

    offsets = tensor_file_offsets(path, locals_by_name)

    raw = path.read_bytes()
    assert offsets.keys() == locals_by_name.keys()
    for name, (offset, record) in offsets.items():
        local = locals_by_name[name]
        nbytes = local.numel() * local.element_size()
        assert raw[offset : offset + nbytes] == local.contiguous().view(torch.uint8).numpy().tobytes(), name
        assert record.offset <= offset and offset + nbytes <= record.offset + record.length, name


def test_rows_read_directly_from_disk_equal_the_mapped_tensor(copy_checkpoint):
    checkpoint = copy_checkpoint("llama-untied-ws3").checkpoint_dir
    path = checkpoint / "model_world_size_3_rank_2.pt"
    name = "model.embed_tokens.weight"
    expected = load_rank_state(path)[name].local.clone()

    with RankReader((str(path),)) as reader:
        local = reader.local(name, 0)
        evict(path)
        assert not in_page_cache(local.data_ptr(), local.numel() * local.element_size())
        rows = torch.empty((3, *expected.shape[1:]), dtype=torch.bfloat16)
        reader.read_rows(name, 0, 5, 8, rows)

    assert torch.equal(rows, expected[5:8].to(torch.bfloat16))


def test_a_pickle_the_reader_does_not_know_is_loaded_by_torch(tmp_path):
    path = tmp_path / "model_world_size_1_rank_0.pt"
    weight = torch.arange(4.0).to(torch.complex64)
    torch.save({"weight": weight}, path)

    state = load_rank_state(path)

    assert torch.equal(state["weight"].local, weight)
    assert state["weight"].file_offset is not None


FOLIO_BYTES = 2 * 1024 * 1024
"""The page cache may hold a file in folios this large, and evicts only whole ones."""


def evict_range(path, offset: int, length: int) -> None:
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def test_uncached_ranges_are_the_evicted_pages_of_a_mapped_range(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(8 * FOLIO_BYTES))
    path.read_bytes()
    evict_range(path, 2 * FOLIO_BYTES, FOLIO_BYTES)
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY) as mapping:
        view = (ctypes.c_char * len(mapping)).from_buffer(mapping)
        ranges = uncached_ranges(ctypes.addressof(view) + 100, 4 * FOLIO_BYTES)
        del view

    assert ranges == [(2 * FOLIO_BYTES - 100, 3 * FOLIO_BYTES - 100)]


def test_rows_partly_evicted_from_the_page_cache_equal_the_mapped_tensor(tmp_path):
    path = tmp_path / "model_world_size_1_rank_0.pt"
    weight = torch.randn(4 * FOLIO_BYTES // 4096, 1024)
    torch.save({"weight": weight}, path)
    path.read_bytes()
    evict_range(path, FOLIO_BYTES, FOLIO_BYTES)

    with RankReader((str(path),)) as reader:
        local = reader.local("weight", 0)
        assert not in_page_cache(local.data_ptr(), local.numel() * local.element_size())
        rows = torch.empty(weight.shape, dtype=torch.bfloat16)
        reader.read_rows("weight", 0, 0, weight.shape[0], rows)

    assert torch.equal(rows, weight.to(torch.bfloat16))
