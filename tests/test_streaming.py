"""Streaming: bounded row chunks, assembled across rank blocks, produced ahead of the writer."""

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from mergeflow.formats.fsdp.index import SourceTensor
from mergeflow.formats.fsdp.placement import Block
from mergeflow.formats.fsdp.reader import BLOCK_READERS, assemble_rows
from mergeflow.output.streaming import prefetched, row_ranges
from tests.merging import load_weights, merge_with_engine


def test_row_ranges_hold_at_most_chunk_bytes():
    assert row_ranges((10, 4), itemsize=4, chunk_bytes=48) == [(0, 3), (3, 6), (6, 9), (9, 10)]


def test_a_row_larger_than_the_chunk_is_one_range():
    assert row_ranges((2, 100), itemsize=4, chunk_bytes=8) == [(0, 1), (1, 2)]


def test_empty_and_scalar_tensors_are_one_range():
    assert row_ranges((0, 4), itemsize=4) == [(0, 0)]
    assert row_ranges((), itemsize=4) == [(0, 0)]


def two_rank_tensor() -> SourceTensor:
    """A (4, 2) tensor split by rows over two ranks."""
    blocks = (Block(0, (0, 0), (2, 2)), Block(1, (2, 0), (2, 2)))
    return SourceTensor("weight", "float32", (4, 2), ("Shard(0)",), blocks)


@pytest.fixture
def pool():
    with ThreadPoolExecutor(BLOCK_READERS) as executor:
        yield executor


def test_the_blocks_of_a_row_range_are_copied_at_the_same_time(pool):
    both_copying = threading.Barrier(2, timeout=10)

    def copy_rows(block, start, stop, into):
        both_copying.wait()
        into.fill_(block.rank)

    rows = assemble_rows(two_rank_tensor(), 0, 4, torch.float32, copy_rows, pool)

    assert rows.tolist() == [[0, 0], [0, 0], [1, 1], [1, 1]]


def test_a_failed_block_copy_is_raised_once_the_other_copies_have_ended(pool):
    both_started = threading.Barrier(2, timeout=10)
    ended = []

    def copy_rows(block, start, stop, into):
        both_started.wait()
        if block.rank == 0:
            raise OSError("rank file went away")
        time.sleep(0.1)
        ended.append(block.rank)

    with pytest.raises(OSError, match="rank file went away"):
        assemble_rows(two_rank_tensor(), 0, 4, torch.float32, copy_rows, pool)
    assert ended == [1]


@pytest.mark.parametrize("name", ["llama-untied-ws3", "qwen2-hsdp-2x2", "qwen2-fsdp1-ws3"])
def test_tiny_chunks_spanning_rank_blocks_give_the_same_tensors(fixtures, tmp_path, name):
    merge_with_engine(fixtures[name].checkpoint_dir, tmp_path / "out", dtype="keep", chunk_bytes=100)

    reference = load_weights(fixtures[name].reference_dir)
    output = load_weights(tmp_path / "out")
    assert all(torch.equal(output[key], tensor) for key, tensor in reference.items())


def test_merge_from_a_cold_page_cache_gives_the_same_tensors(copy_checkpoint, tmp_path):
    fixture = copy_checkpoint("llama-untied-ws3")
    os.sync()
    for path in fixture.checkpoint_dir.glob("*.pt"):
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)

    merge_with_engine(fixture.checkpoint_dir, tmp_path / "out", dtype="keep")

    reference = load_weights(fixture.reference_dir)
    output = load_weights(tmp_path / "out")
    assert all(torch.equal(output[key], tensor) for key, tensor in reference.items())


def test_prefetched_yields_every_item_in_order():
    assert list(prefetched(iter(range(50)), depth=2)) == list(range(50))


def test_prefetched_raises_the_producers_error_in_the_consumer():
    def failing():
        yield 1
        raise ValueError("shard went away")

    with pytest.raises(ValueError, match="shard went away"):
        list(prefetched(failing()))


def test_prefetched_stops_the_producer_when_the_consumer_stops():
    produced = []

    def endless():
        for number in range(10_000):
            produced.append(number)
            yield number

    for item in prefetched(endless(), depth=2):
        if item == 3:
            break

    assert len(produced) < 10
    assert not [t for t in threading.enumerate() if t.name == "mergeflow-prefetch"]
