"""CRC-32 checks of zip records read in pieces, in any order.

`torch.save` writes every storage as an uncompressed zip record, and the zip directory holds each
record's CRC-32; `torch.load` never checks it. A merge reads a record's bytes in pieces (a block of rows
at a time, from several threads, an expert's rows out of order), so each piece's CRC is taken as it is
read and the pieces are combined (`crc32_combine`; ISA-L's CRC-32, `isal`, runs at about three times zlib's
speed here). Bytes of a record that no piece covered (storage padding) are read from the file when the check
ends.
"""

import threading
from collections.abc import Callable
from dataclasses import dataclass

from isal.isal_zlib import crc32, crc32_combine


@dataclass(frozen=True)
class StoredRecord:
    """One uncompressed zip record: where its bytes lie in the file, and their CRC-32 from the zip directory."""

    key: str
    offset: int
    length: int
    crc32: int


class RecordCorrupt(Exception):
    """A record's bytes do not match the CRC-32 the zip directory holds for them."""


ReadBytes = Callable[[int, int], bytes]
"""`read(offset, length)`: bytes of the file, for the parts of a record no piece covered."""


class RecordCheck:
    """The CRC-32 of one record, from pieces of it added in any order; `finish` compares it."""

    def __init__(self, record: StoredRecord):
        self.record = record
        self._prefix = (0, 0)
        """(length, CRC-32) of the record's first bytes, as far as pieces read in order reach."""
        self._pieces: dict[int, tuple[int, int]] = {}
        """Offset within the record -> (length, CRC-32) of a piece read out of order."""
        self._lock = threading.Lock()

    def add(self, file_offset: int, data) -> None:
        """A piece of the record read at `file_offset` of the file (a bytes-like object). A piece that
        continues the bytes read so far extends their CRC; any other is kept to be combined at the end."""
        start = file_offset - self.record.offset
        length = memoryview(data).nbytes
        if length == 0:
            return
        if start < 0 or start + length > self.record.length:
            raise ValueError(f"bytes {start}..{start + length} are outside record {self.record.key}")
        with self._lock:
            covered, crc = self._prefix
            if start == covered:
                self._prefix = (covered + length, crc32(data, crc))
                return
        crc = crc32(data)
        with self._lock:
            self._pieces[start] = (length, crc)

    def finish(self, read: ReadBytes) -> None:
        """Combine the pieces in order, reading what they leave out, and compare with the stored CRC-32.

        Raises:
            RecordCorrupt: the record's bytes are not the ones `torch.save` wrote.
        """
        with self._lock:
            covered, crc = self._prefix
            pieces = sorted(self._pieces.items())
        for start, (length, piece_crc) in pieces:
            if start + length <= covered:
                continue
            if start < covered:  # overlapping pieces: take the rest of this one from the file
                crc = crc32(read(self.record.offset + covered, start + length - covered), crc)
            else:
                if start > covered:
                    crc = crc32(read(self.record.offset + covered, start - covered), crc)
                crc = crc32_combine(crc, piece_crc, length)
            covered = start + length
        if covered < self.record.length:
            crc = crc32(read(self.record.offset + covered, self.record.length - covered), crc)
        if crc != self.record.crc32:
            raise RecordCorrupt(
                f"record {self.record.key} ({self.record.length} bytes) has CRC-32 {crc:08x}, "
                f"its zip directory says {self.record.crc32:08x}"
            )
