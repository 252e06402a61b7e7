"""A streaming safetensors writer: the header first, then each tensor's bytes in order, chunk by chunk.

safetensors itself serialises whole in-memory tensors; this writes the same format from pieces, so
no tensor, and never the model, has to be resident at once.
"""

import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from mergeflow.dtypes import SAFETENSORS_CODES, parse_dtype_name

HEADER_ALIGNMENT = 8


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


class SafetensorsWriter:
    """Writes one .safetensors file whose tensors arrive in header order, possibly in several chunks each."""

    def __init__(self, path: Path, entries: Sequence[TensorEntry]):
        self.path = Path(path)
        self._entries = list(entries)
        self._position = 0
        self._written = 0
        self._file = open(self.path, "wb")
        self._file.write(build_header(self._entries))

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
        self._file.flush()
        os.fsync(self._file.fileno())
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
            self._file.close()
