"""PyTorch Distributed Checkpoint (DCP) archives, as Megatron's `torch_dist` format and torchtitan write them: a
pickled `.metadata` (global shape, dtype and chunks of every tensor) and `__R_K.distcp` files that
hold each chunk as a `torch.save` blob at a recorded offset.

`.metadata` is a plain pickle, so it is read with an unpickler that resolves only the classes DCP
metadata is made of: anything else is refused, never imported or run. Chunks load with
`torch.load(weights_only=True)`.
"""

import io
import math
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from mergeflow.errors import CheckpointError
from mergeflow.formats.dcp_files import METADATA_FILE

DCP_ALLOWED_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {
        "SavePlan",
        "WriteItem",
        "WriteItemType",
        "TensorWriteData",
        "BytesIOWriteData",
    },
    "torch.serialization": {"_get_layout"},
    "torch": {"Size", "strided", "contiguous_format", "preserve_format", "channels_last"},
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "PurePosixPath", "PureWindowsPath"},  # StorageMeta.checkpoint_id, as DCP records it
    "builtins": {"set", "frozenset", "slice"},
}
CHECK_READ_BYTES = 16 * 1024 * 1024
DTYPE_NAMES = {name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)}


@dataclass(frozen=True)
class Chunk:
    """One stored piece of a global tensor: where it sits in the tensor and in which file."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    """Relative to the checkpoint directory."""
    byte_offset: int
    byte_length: int


@dataclass(frozen=True)
class StoredTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in DCP_ALLOWED_GLOBALS.get(module, ()) or (module == "torch" and name in DTYPE_NAMES):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")


def read_metadata(checkpoint_dir: Path) -> dict[str, StoredTensor]:
    """Every tensor of a DCP archive, from `.metadata` alone (byte blobs such as `_extra_state` left out).

    Raises:
        CheckpointError: `.metadata` is missing, unreadable, asks for other code, or lists chunks
            that are not stored or do not cover their tensor.
    """
    path = Path(checkpoint_dir) / METADATA_FILE
    if not path.is_file():
        raise CheckpointError(f"not a DCP archive: {checkpoint_dir} has no {METADATA_FILE} file")
    import torch.distributed.checkpoint.metadata  # noqa: F401  (the classes the metadata refers to)

    try:
        with open(path, "rb") as file:
            metadata = _MetadataUnpickler(file).load()
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"unsafe or corrupt {path}: {e}") from e
    except (OSError, EOFError, AttributeError, ValueError, TypeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e
    storage = {(index.fqn, tuple(index.offset or ())): info for index, info in metadata.storage_data.items()}
    tensors = {}
    for name, entry in metadata.state_dict_metadata.items():
        if not hasattr(entry, "chunks"):
            continue
        chunks = []
        for chunk in entry.chunks:
            info = storage.get((name, tuple(chunk.offsets)))
            if info is None:
                raise CheckpointError(f"{path} lists a chunk of {name} at {tuple(chunk.offsets)} with no stored data")
            chunks.append(Chunk(tuple(chunk.offsets), tuple(chunk.sizes), info.relative_path, info.offset, info.length))
        shape = tuple(entry.size)
        if sum(math.prod(chunk.sizes) for chunk in chunks) != math.prod(shape):
            raise CheckpointError(f"{path}: the chunks of {name} do not cover its shape {shape}")
        tensors[name] = StoredTensor(name, entry.properties.dtype, shape, tuple(chunks))
    return tensors


class _FileWindow(io.RawIOBase):
    """A seekable, read-only view of `length` bytes of a file starting at `start`."""

    def __init__(self, file, start: int, length: int):
        self._file, self._start, self._length, self._position = file, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        self._position = max(0, min(self._length, base + offset))
        return self._position

    def readinto(self, buffer) -> int:
        count = min(len(buffer), self._length - self._position)
        if count <= 0:
            return 0
        self._file.seek(self._start + self._position)
        read = self._file.readinto(memoryview(buffer)[:count])
        self._position += read
        return read


def _check_records(blob) -> None:
    """Read every record of a chunk's `torch.save` blob: zipfile checks each one's CRC-32 as it reads it.

    Raises:
        zipfile.BadZipFile: a record does not match its CRC-32, or the blob is not a zip.
    """
    with zipfile.ZipFile(blob) as archive:
        for info in archive.infolist():
            with archive.open(info) as record:
                while record.read(CHECK_READ_BYTES):
                    pass


def load_chunk(checkpoint_dir: Path, tensor: StoredTensor, chunk: Chunk) -> torch.Tensor:
    """One chunk's values, checked against the CRC-32s of its `torch.save` blob and the metadata's shape and
    dtype."""
    path = Path(checkpoint_dir) / chunk.file
    try:
        with open(path, "rb") as file:
            window = io.BufferedReader(_FileWindow(file, chunk.byte_offset, chunk.byte_length))
            _check_records(window)
            window.seek(0)
            value = torch.load(window, map_location="cpu", weights_only=True)
    except FileNotFoundError as e:
        raise CheckpointError(f"missing data file {path} (holds {tensor.name})") from e
    except zipfile.BadZipFile as e:
        raise CheckpointError(
            f"corrupt data file {path}: the chunk of {tensor.name} at byte {chunk.byte_offset} is damaged ({e})",
            hint="the file changed after it was saved: copy it again from where training saved it",
        ) from e
    except Exception as e:
        raise CheckpointError(f"cannot read {tensor.name} from {path} at byte {chunk.byte_offset}: {e}") from e
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != chunk.sizes or value.dtype != tensor.dtype:
        raise CheckpointError(
            f"{path} at byte {chunk.byte_offset} does not hold the {chunk.sizes} {tensor.dtype} chunk of {tensor.name}"
        )
    return value


def read_slice(checkpoint_dir: Path, tensor: StoredTensor, leading: tuple[int, ...] = ()) -> torch.Tensor:
    """`tensor[leading]`, the sub-tensor at fixed indices of its first dims (one layer, one expert, or all
    of it with none), assembled from the chunks that hold it."""
    depth = len(leading)
    out = torch.empty(tensor.shape[depth:], dtype=tensor.dtype)
    for chunk in tensor.chunks:
        spans = zip(leading, chunk.offsets, chunk.sizes, strict=False)
        if not all(offset <= index < offset + size for index, offset, size in spans):
            continue
        within = tuple(index - offset for index, offset in zip(leading, chunk.offsets, strict=False))
        value = load_chunk(checkpoint_dir, tensor, chunk)[within]
        target = out
        for dim in range(depth, len(tensor.shape)):
            target = target.narrow(dim - depth, chunk.offsets[dim], chunk.sizes[dim])
        target.copy_(value)
    return out
