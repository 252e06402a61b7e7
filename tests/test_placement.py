"""DTensor placement maths, on literal shapes."""

import pytest

from mergeflow.formats.fsdp.placement import Block, chunk_bounds, covers_exactly, local_block, unique_blocks


@pytest.mark.parametrize(
    ("size", "parts", "expected"),
    [
        (10, 4, [(0, 3), (3, 6), (6, 9), (9, 10)]),
        (5, 4, [(0, 2), (2, 4), (4, 5), (5, 5)]),  # torch.chunk makes 3 chunks: the 4th rank is empty
        (2, 3, [(0, 1), (1, 2), (2, 2)]),
        (8, 2, [(0, 4), (4, 8)]),
    ],
)
def test_chunk_bounds_follow_torch_chunk(size, parts, expected):
    assert [chunk_bounds(size, parts, i) for i in range(parts)] == expected


def test_shard_on_one_mesh_dim():
    assert local_block((10, 4), (4,), (3,), ("shard:0",)) == ((9, 0), (1, 4))


def test_replicate_then_shard_is_hsdp():
    assert local_block((10, 4), (2, 2), (1, 1), ("replicate", "shard:0")) == ((5, 0), (5, 4))


def test_shard_on_a_later_dim():
    assert local_block((4, 9), (2,), (1,), ("shard:1",)) == ((0, 5), (4, 4))


def test_two_mesh_dims_sharding_the_same_dim_nest():
    assert local_block((8,), (2, 2), (1, 0), ("shard:0", "shard:0")) == ((4,), (2,))


def test_unique_blocks_read_each_replica_once_from_the_lowest_rank():
    blocks = [Block(2, (0,), (5,)), Block(0, (0,), (5,)), Block(3, (5,), (5,)), Block(1, (5,), (5,))]

    assert unique_blocks(blocks) == (Block(0, (0,), (5,)), Block(1, (5,), (5,)))


def test_unique_blocks_drop_empty_shards():
    assert unique_blocks([Block(0, (0,), (2,)), Block(1, (2,), (0,))]) == (Block(0, (0,), (2,)),)


def test_blocks_that_miss_a_piece_do_not_cover():
    assert not covers_exactly((10,), [Block(0, (0,), (5,))])


def test_blocks_that_tile_cover():
    assert covers_exactly((10, 2), [Block(0, (0, 0), (5, 2)), Block(1, (5, 0), (5, 2))])
