"""Reading tensor data out of rank files: file offsets, direct reads, and the mapping fallback."""

import os

import torch

from mergeflow.fsdp import load_rank_state, local_tensor
from mergeflow.pages import in_page_cache
from mergeflow.rank_reader import RankReader, tensor_file_offsets


def evict(path) -> None:
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def test_file_offsets_point_at_each_tensors_bytes(fixtures):
    path = fixtures["qwen2-ws2"].checkpoint_dir / "model_world_size_2_rank_1.pt"
    state = load_rank_state(path)

    offsets = tensor_file_offsets(path, state)

    raw = path.read_bytes()
    assert offsets.keys() == state.keys()
    for name, offset in offsets.items():
        local = local_tensor(state[name])
        nbytes = local.numel() * local.element_size()
        assert raw[offset : offset + nbytes] == local.contiguous().view(torch.uint8).numpy().tobytes(), name


def test_rows_read_directly_from_disk_equal_the_mapped_tensor(copy_checkpoint):
    checkpoint = copy_checkpoint("llama-untied-ws3").checkpoint_dir
    path = checkpoint / "model_world_size_3_rank_2.pt"
    name = "model.embed_tokens.weight"
    expected = local_tensor(load_rank_state(path)[name]).clone()

    with RankReader((str(path),)) as reader:
        local = reader.local(name, 0)
        evict(path)
        assert not in_page_cache(local.data_ptr(), local.numel() * local.element_size())
        rows = torch.empty((3, *expected.shape[1:]), dtype=torch.bfloat16)
        reader.read_rows(name, 0, 5, 8, rows)

    assert torch.equal(rows, expected[5:8].to(torch.bfloat16))
