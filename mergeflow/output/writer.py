"""A streaming safetensors writer: the header first, then each tensor's bytes in order, chunk by chunk, so no
tensor has to be resident whole; bytes go out with O_DIRECT where the filesystem allows it."""

import errno
import fcntl
import json
import mmap
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from mergeflow.dtypes import SAFETENSORS_CODES, parse_dtype_name
from mergeflow.output.staging import FILE_MODE

HEADER_ALIGNMENT = 8
DIRECT_ALIGNMENT = 4096
WRITE_BUFFER_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * parse_dtype_name(self.dtype).itemsize


def build_header(entries: Sequence[TensorEntry], metadata: dict[str, str] | None = None) -> bytes:
    """The length-prefixed JSON header, padded with spaces to 8 bytes, for tensors stored back to back."""
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for entry in entries:
        header[entry.name] = {
            "dtype": SAFETENSORS_CODES[parse_dtype_name(entry.dtype)],
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % HEADER_ALIGNMENT)
    return struct.pack("<Q", len(encoded)) + encoded


class AlignedFile:
    """A write-only file filled sequentially through a page-aligned buffer, with O_DIRECT when possible.

    Full buffers go out as aligned direct writes; the last, partial block is padded and the file is
    truncated to its exact size. Where O_DIRECT is refused (tmpfs, some network filesystems) the
    same writes are buffered.
    """

    def __init__(self, path: Path, buffer_bytes: int = WRITE_BUFFER_BYTES):
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        direct = getattr(os, "O_DIRECT", 0)
        try:
            self._fd = os.open(path, flags | direct, FILE_MODE)
            self.direct = bool(direct)
        except OSError:
            self._fd = os.open(path, flags, FILE_MODE)
            self.direct = False
        self._buffer = mmap.mmap(-1, buffer_bytes)
        self._view = memoryview(self._buffer)
        self._filled = 0
        self.size = 0

    def write(self, data: memoryview) -> None:
        data = data.cast("B")
        position = 0
        while position < len(data):
            count = min(len(data) - position, len(self._view) - self._filled)
            self._view[self._filled : self._filled + count] = data[position : position + count]
            self._filled += count
            position += count
            if self._filled == len(self._view):
                self._flush(self._filled)
        self.size += len(data)

    def _flush(self, count: int) -> None:
        """Write the buffer's first `count` bytes; the buffer is free again."""
        written = 0
        while written < count:
            try:
                written += os.write(self._fd, self._view[written:count])
            except OSError as e:
                if e.errno != errno.EINVAL or not self.direct:
                    raise
                self._stop_direct_io()
        self._filled = 0

    def _stop_direct_io(self) -> None:
        flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
        self.direct = False

    def close(self) -> None:
        try:
            tail = self._filled
            padded = -(-tail // DIRECT_ALIGNMENT) * DIRECT_ALIGNMENT if self.direct else tail
            self._view[tail:padded] = bytes(padded - tail)
            self._flush(padded)
            os.ftruncate(self._fd, self.size)
            os.fsync(self._fd)  # on the device before it is renamed into place and vouched for by its marker
        finally:
            self.abort()

    def abort(self) -> None:
        os.close(self._fd)
        self._view.release()
        self._buffer.close()


class SafetensorsWriter:
    """Writes one .safetensors file whose tensors arrive in header order, possibly in several chunks each."""

    def __init__(self, path: Path, entries: Sequence[TensorEntry]):
        self.path = Path(path)
        self._entries = list(entries)
        self._position = 0
        self._written = 0
        self._file = AlignedFile(self.path)
        self._file.write(memoryview(build_header(self._entries)))

    def write(self, name: str, chunk: torch.Tensor) -> None:
        """Append the next bytes of tensor `name`; chunks must come in order and add up to the tensor."""
        entry = self._entries[self._position]
        if name != entry.name:
            raise ValueError(f'{self.path}: expected bytes of "{entry.name}", got "{name}"')
        data = chunk.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        if self._written + data.nbytes > entry.nbytes:
            raise ValueError(f'{self.path}: too many bytes for "{name}" ({entry.nbytes} expected)')
        self._file.write(memoryview(data))
        self._written += data.nbytes
        if self._written == entry.nbytes:
            self._position += 1
            self._written = 0

    def close(self) -> None:
        """Finish the file; it must have received every tensor in full."""
        complete = self._position == len(self._entries)
        self._file.close()
        if not complete:
            missing = self._entries[self._position].name
            raise ValueError(f'{self.path}: closed before tensor "{missing}" was written')

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, exc_type, *exc_info) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.abort()
