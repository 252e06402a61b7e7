"""CRC-32 checks of zip records read in pieces: any order of pieces, any gaps, gives zlib's CRC of the whole."""

import random
import zlib

import pytest

from mergeflow.formats.record_check import RecordCheck, RecordCorrupt, StoredRecord

DATA = random.Random(0).randbytes(100_000)
OFFSET = 123
"""Where the record's bytes start in its (imagined) file."""


def read(offset: int, length: int, data: bytes = DATA) -> bytes:
    return data[offset - OFFSET : offset - OFFSET + length]


@pytest.mark.parametrize(
    "pieces",
    [
        [(0, 100_000)],
        [(0, 10), (10, 50_000), (50_000, 100_000)],  # in order
        [(50_000, 100_000), (0, 50_000)],  # reversed
        [(30_000, 60_000), (0, 1_000), (50_000, 70_000)],  # overlapping, with gaps read from the file
        [],  # nothing read: the whole record comes from the file
    ],
)
def test_pieces_in_any_order_match_the_stored_crc(pieces):
    check = RecordCheck(StoredRecord("data/0", OFFSET, len(DATA), zlib.crc32(DATA)))
    for start, stop in pieces:
        check.add(OFFSET + start, DATA[start:stop])

    check.finish(read)


def test_a_flipped_byte_outside_every_piece_is_found():
    damaged = bytearray(DATA)
    damaged[99_000] ^= 0x20
    check = RecordCheck(StoredRecord("data/0", OFFSET, len(DATA), zlib.crc32(DATA)))
    check.add(OFFSET, bytes(damaged[:50_000]))

    with pytest.raises(RecordCorrupt, match="record data/0"):
        check.finish(lambda offset, length: read(offset, length, bytes(damaged)))


def test_a_flipped_byte_inside_a_piece_is_found():
    damaged = bytearray(DATA)
    damaged[10] ^= 0x01
    check = RecordCheck(StoredRecord("data/0", OFFSET, len(DATA), zlib.crc32(DATA)))
    check.add(OFFSET, bytes(damaged))

    with pytest.raises(RecordCorrupt):
        check.finish(read)


def test_a_piece_outside_the_record_is_refused():
    check = RecordCheck(StoredRecord("data/0", OFFSET, 10, 0))

    with pytest.raises(ValueError, match="outside record data/0"):
        check.add(OFFSET + 5, b"0123456789")
