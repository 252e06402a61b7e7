"""Read a rank file's pickle into plain records: the C unpickler, with every global the file names resolved to
a record class of ours (nothing named by the file is called), and the tensor data memory-mapped. A pickle
naming anything else raises `UnknownPickle`, and the caller falls back to `torch.load(weights_only=True)`."""

import io
import math
import mmap
import pickle
import struct
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from mergeflow.formats.fsdp.placement import REPLICATE, shard
from mergeflow.formats.record_check import StoredRecord

DATA_PICKLE = "data.pkl"
DATA_RECORD_DIR = "data"
ZIP_LOCAL_HEADER_SIZE = 30
ZIP_NAME_LENGTHS_AT = 26


class UnknownPickle(Exception):
    """The pickle names a global, or holds a structure, outside what this reader knows."""


@dataclass(frozen=True)
class MeshPosition:
    """Where one rank sits in the device mesh its DTensors use."""

    shape: tuple[int, ...]
    dim_names: tuple[str, ...] | None
    coordinate: tuple[int, ...]

    @property
    def key(self) -> tuple[tuple[int, ...], tuple[str, ...] | None]:
        """What tells one mesh from another: its shape and dim names."""
        return self.shape, self.dim_names


@dataclass(frozen=True)
class RankTensor:
    """One entry of a rank's state dict: its local data (memory-mapped) and, for a DTensor, how it is placed."""

    local: torch.Tensor
    shape: tuple[int, ...]
    """The global shape (the local one for a plain tensor)."""
    dtype: torch.dtype
    placements: tuple[str, ...] | None = None
    """`placement` names of a DTensor's placements; None for a plain tensor."""
    mesh: MeshPosition | None = None
    file_offset: int | None = None
    """Where the local data's first byte lies in the rank file, if it is contiguous there."""
    record: StoredRecord | None = None
    """The zip record holding the local data's storage (with its CRC-32), when it is stored uncompressed."""

    @property
    def is_dtensor(self) -> bool:
        return self.placements is not None


class _Record:
    """What a global named by the pickle becomes: its constructor arguments and pickled state, nothing run."""

    def __new__(cls, *args):
        record = object.__new__(cls)
        record.args = args
        record.state = {}
        return record

    def __init__(self, *args):
        pass

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2:
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict):
            raise UnknownPickle(f"{type(self).__name__} with state {type(state).__name__}")
        self.state = state


def _record_class(name: str) -> type:
    return type(name, (_Record,), {})


@dataclass(frozen=True)
class _StorageRef:
    key: str
    dtype: torch.dtype


@dataclass(frozen=True)
class _TensorRef:
    storage: _StorageRef
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(frozen=True)
class _WrapperRef:
    cls: type
    dtype: torch.dtype
    size: tuple[int, ...]


def _rebuild_tensor(storage, storage_offset, size, stride, *_ignored) -> _TensorRef:
    if not isinstance(storage, _StorageRef):
        raise UnknownPickle("a tensor without a storage record")
    return _TensorRef(storage, int(storage_offset), tuple(size), tuple(stride))


def _rebuild_parameter(data, *_ignored):
    return data


def _rebuild_wrapper_subclass(cls, dtype, size, *_ignored) -> _WrapperRef:
    return _WrapperRef(cls, dtype, tuple(size))


def _rebuild_from_type(func, new_type, args, state):
    rebuilt = func(*args)
    if isinstance(rebuilt, _WrapperRef) and new_type is _DTensor and rebuilt.cls is _DTensor:
        record = _DTensor()
        record.__setstate__(state)
        record.args = (rebuilt,)
        return record
    if isinstance(rebuilt, _TensorRef) and new_type is _PlainTensor and not state:
        return rebuilt
    raise UnknownPickle(f"a tensor rebuilt as {getattr(new_type, '__name__', new_type)}")


_DTensor = _record_class("DTensor")
_PlainTensor = _record_class("Tensor")
_Shard = _record_class("Shard")
_Replicate = _record_class("Replicate")
_STORAGE_DTYPES = {
    "BFloat16Storage": torch.bfloat16,
    "BoolStorage": torch.bool,
    "ByteStorage": torch.uint8,
    "CharStorage": torch.int8,
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "IntStorage": torch.int32,
    "LongStorage": torch.int64,
    "ShortStorage": torch.int16,
}
"""The legacy storage class names `torch.save` writes, by the dtype each holds."""
_GLOBALS = {
    ("collections", "OrderedDict"): OrderedDict,
    ("torch", "Size"): tuple,
    ("torch", "Tensor"): _PlainTensor,
    ("torch", "device"): str,
    ("torch.serialization", "_get_layout"): str,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_wrapper_subclass"): _rebuild_wrapper_subclass,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch.nn.parameter", "Parameter"): _rebuild_parameter,
    ("torch.distributed.tensor", "DTensor"): _DTensor,
    **{
        (module, name): _record_class(name)
        for module, name in (
            ("torch.distributed.tensor._dtensor_spec", "DTensorSpec"),
            ("torch.distributed.tensor._dtensor_spec", "TensorMeta"),
            ("torch.distributed.tensor._dtensor_spec", "ShardOrderEntry"),
            ("torch.distributed.device_mesh", "DeviceMesh"),
            ("torch.distributed._mesh_layout", "_MeshLayout"),
            ("torch.distributed._mesh_layout", "_FlatLayout"),
        )
    },
    ("torch.distributed.tensor.placement_types", "Shard"): _Shard,
    ("torch.distributed.tensor.placement_types", "Replicate"): _Replicate,
}


class _RankUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _GLOBALS:
            return _GLOBALS[(module, name)]
        if module == "torch" and name in _STORAGE_DTYPES:
            return name
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnknownPickle(f"global {module}.{name}")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and pid[1] in _STORAGE_DTYPES):
            raise UnknownPickle(f"persistent id {pid!r:.80}")
        return _StorageRef(str(pid[2]), _STORAGE_DTYPES[pid[1]])


def read_rank_pickle(path: str | Path) -> dict[str, RankTensor]:
    """The rank file's state dict as records over a private memory mapping of the file.

    Raises:
        UnknownPickle: the pickle is not one this reader knows, or is malformed (the caller falls back to
            torch.load, whose error then describes it).
        zipfile.BadZipFile, OSError: the file is not a readable zip, or a record other than tensor data
            (the pickle among them) does not match its CRC-32.
    """
    with open(path, "rb") as file, zipfile.ZipFile(file) as archive:
        pickle_name = next((n for n in archive.namelist() if n.split("/")[-1] == DATA_PICKLE), None)
        if pickle_name is None:
            raise UnknownPickle(f"no {DATA_PICKLE}")
        check_metadata_records(archive)
        records = _data_records(file, archive)
        try:
            state = _RankUnpickler(io.BytesIO(archive.read(pickle_name))).load()
            mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY) if records else None
            if not isinstance(state, dict):
                raise UnknownPickle(f"a {type(state).__name__}, not a state dict")
            return {str(name): _rank_tensor(value, records, mapping) for name, value in state.items()}
        except UnknownPickle:
            raise
        except Exception as e:
            raise UnknownPickle(f"{type(e).__name__}: {e}") from e


def _is_data_record(info: zipfile.ZipInfo) -> bool:
    directory = info.filename.rpartition("/")[0]
    return directory.rpartition("/")[2] == DATA_RECORD_DIR


def check_metadata_records(archive: zipfile.ZipFile) -> None:
    """Read every record that is not tensor data (the pickle, the format version, the byte order): zipfile
    checks each one's CRC-32 as it reads it. Tensor data is checked while a merge reads it.

    Raises:
        zipfile.BadZipFile: a record does not match its CRC-32.
    """
    for info in archive.infolist():
        if not _is_data_record(info):
            archive.read(info)


def _data_records(file, archive: zipfile.ZipFile) -> dict[str, StoredRecord | None]:
    """Storage key -> where its bytes lie in the file and their CRC-32; None for a compressed record."""
    records: dict[str, StoredRecord | None] = {}
    for info in archive.infolist():
        if not _is_data_record(info):
            continue
        key = info.filename.rpartition("/")[2]
        if info.compress_type != zipfile.ZIP_STORED:
            records[key] = None
            continue
        file.seek(info.header_offset + ZIP_NAME_LENGTHS_AT)
        name_length, extra_length = struct.unpack("<HH", file.read(4))
        offset = info.header_offset + ZIP_LOCAL_HEADER_SIZE + name_length + extra_length
        records[key] = StoredRecord(key, offset, info.file_size, info.CRC)
    return records


def tensor_file_offsets(
    path: str | Path, locals_by_name: dict[str, torch.Tensor]
) -> dict[str, tuple[int, StoredRecord]]:
    """Where each contiguous tensor of a `torch.load(mmap=True)` state lies in its file, and its record.

    A memory-mapped load maps the whole file once and slices each storage out of it at its record's
    offset, so storage addresses differ exactly as record offsets do. The mapping's base address is
    the one that puts every storage on a record start (records of empty tensors hold no storage, so
    the lowest storage need not be the first record); without one, no offsets are returned and the
    reader copies out of the mapping instead.
    """
    with open(path, "rb") as file, zipfile.ZipFile(file) as archive:
        records = {record.offset: record for record in _data_records(file, archive).values() if record is not None}
    storages = {
        name: (local.untyped_storage().data_ptr(), local)
        for name, local in locals_by_name.items()
        if local.numel() > 0 and local.is_contiguous()
    }
    if not storages or not records:
        return {}
    pointers = {pointer for pointer, _ in storages.values()}
    lowest = min(pointers)
    bases = (lowest - record for record in sorted(records))
    base = next((b for b in bases if all(pointer - b in records for pointer in pointers)), None)
    if base is None:
        return {}
    return {
        name: (pointer - base + local.storage_offset() * local.element_size(), records[pointer - base])
        for name, (pointer, local) in storages.items()
    }


def _rank_tensor(value, records: dict[str, StoredRecord | None], mapping: mmap.mmap | None) -> RankTensor:
    if isinstance(value, _TensorRef):
        local, offset = _mapped(value, records, mapping)
        record = records[value.storage.key]
        return RankTensor(local, tuple(local.shape), local.dtype, file_offset=offset, record=record)
    if isinstance(value, _DTensor):
        wrapper, local_ref, spec = value.args[0], value.state.get("_local_tensor"), value.state.get("_spec")
        if not isinstance(local_ref, _TensorRef) or spec is None:
            raise UnknownPickle("a DTensor without its local tensor and spec")
        local, offset = _mapped(local_ref, records, mapping)
        placements = tuple(_placement_name(p) for p in spec.state.get("placements", ()))
        return RankTensor(local, wrapper.size, wrapper.dtype, placements, _mesh_position(spec.state.get("mesh")),
                          offset, records[local_ref.storage.key])
    raise UnknownPickle(f"a state dict entry of type {type(value).__name__}")


def _mapped(ref: _TensorRef, records: dict[str, StoredRecord | None], mapping) -> tuple[torch.Tensor, int | None]:
    record = records.get(ref.storage.key)
    if record is None:
        raise UnknownPickle(f"storage {ref.storage.key} has no stored (uncompressed) data record")
    start, length = record.offset, record.length
    itemsize = ref.storage.dtype.itemsize
    needed = ref.storage_offset + sum((s - 1) * d for s, d in zip(ref.size, ref.stride, strict=True)) + 1
    if math.prod(ref.size) and needed * itemsize > length:
        raise UnknownPickle(f"tensor past the end of storage {ref.storage.key}")
    if length == 0 or mapping is None:
        return torch.empty(ref.size, dtype=ref.storage.dtype), None
    storage = torch.frombuffer(mapping, dtype=ref.storage.dtype, count=length // itemsize, offset=start)
    local = storage.as_strided(ref.size, ref.stride, ref.storage_offset)
    return local, (start + ref.storage_offset * itemsize if local.is_contiguous() else None)


def _placement_name(placement) -> str:
    if type(placement) is _Shard and isinstance(placement.state.get("dim"), int):
        return shard(placement.state["dim"])
    if type(placement) is _Replicate:
        return REPLICATE
    raise UnknownPickle(f"placement {type(placement).__name__}")


def _mesh_position(mesh) -> MeshPosition:
    """The mesh's shape (its layout's top-level sizes), dim names, and this rank's coordinate in it."""
    state = getattr(mesh, "state", None) or {}
    layout, coordinate = state.get("_layout"), state.get("_coordinate_on_dim")
    if layout is None or not isinstance(coordinate, (tuple, list)):
        raise UnknownPickle("a device mesh without a layout and this rank's coordinate")
    axes = layout.state.get("axes", ()) if isinstance(layout, _Record) else ()
    shape = tuple(math.prod(_flattened(axis.state.get("shape", ()))) for axis in axes)
    names = state.get("_mesh_dim_names")
    if not shape or len(coordinate) != len(shape):
        raise UnknownPickle("a device mesh whose layout does not match its coordinate")
    return MeshPosition(shape, tuple(names) if names is not None else None, tuple(int(c) for c in coordinate))


def _flattened(shape) -> list[int]:
    if isinstance(shape, int):
        return [shape]
    return [size for part in shape for size in _flattened(part)]
