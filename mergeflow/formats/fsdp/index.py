"""The index of a verl FSDP checkpoint (one pickle of DTensor shards per rank): which rank blocks make up
each global tensor, from every rank's metadata (the tensors stay on disk, memory-mapped)."""

import contextlib
import dataclasses
import logging
import math
import os
import pickle
import zipfile
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mergeflow.dtypes import dtype_name
from mergeflow.errors import CheckpointError, quoted
from mergeflow.formats.fsdp.expert_split import ExpertSplit, expert_split, is_expert_mesh
from mergeflow.formats.fsdp.layout import RankFiles, no_zip_directory
from mergeflow.formats.fsdp.placement import (
    REPLICATE,
    Block,
    covers_exactly,
    local_block,
    shard,
    unique_blocks,
)

if TYPE_CHECKING:
    from mergeflow.formats.fsdp.reader import FsdpSource
from mergeflow.formats.fsdp.rank_pickle import (
    MeshPosition,
    RankTensor,
    UnknownPickle,
    read_rank_pickle,
    tensor_file_offsets,
)

SUPPORTED_MESH_DIM_NAMES = frozenset({"fsdp", "ddp", "dp", "dp_shard", "dp_replicate", "dp_shard_cp", "dp_shard_sp"})
"""Mesh dims that shard or replicate parameters as FSDP does: torchtitan's and verl's names, and the flattened
data-parallel dims that also span the context- or sequence-parallel ranks (`dp_shard_cp`; VeOmni's `dp_shard_sp`
with Ulysses), whose ranks each hold a shard of every parameter."""
WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
CORRUPT_HINT = "the file changed after torch.save wrote it: copy it again from where training saved it"


@dataclass(frozen=True)
class SourceTensor:
    """One tensor of the checkpoint: its global shape and dtype, and the rank blocks that hold it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    placements: tuple[str, ...]
    blocks: tuple[Block, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ShardIndex:
    """What every rank file holds, read from metadata alone: the FSDP backend's `TensorIndex`."""

    checkpoint_dir: str
    world_size: int
    rank_files: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...] | None
    tensors: dict[str, SourceTensor]
    aliases: dict[str, str]
    """Names whose tensor shares storage with an earlier name (tied weights), mapped to that name."""
    fsdp_version: int | None = None
    expert_parallel: int = 1
    """VeOmni's expert-parallel size: how many groups of ranks the experts are split over (`expert_split`)."""
    loaded: "LoadedRanks" = field(default_factory=lambda: LoadedRanks(), compare=False, repr=False)

    def facts(self) -> dict[str, object]:
        return {
            "fsdp_version": self.fsdp_version,
            "mesh_shape": list(self.mesh_shape),
            "mesh_dim_names": list(self.mesh_dim_names) if self.mesh_dim_names else None,
            "expert_parallel": self.expert_parallel,
            "placements": dict(Counter(",".join(t.placements) or "plain" for t in self.tensors.values())),
        }

    def byte_ranges(self, names: Iterable[str]) -> list[tuple[str, int, int]]:
        """(rank file, offset, length) of each named tensor's rank blocks, tensor by tensor in the given order (what
        the merge reads, for reading it ahead)."""
        states: dict[int, dict[str, RankTensor]] = {}
        ranges = []
        for name in names:
            for block in self.tensors[name].blocks if name in self.tensors else ():
                if block.rank not in states:
                    states[block.rank] = self.loaded.state(self.rank_files[block.rank])
                tensor = states[block.rank].get(name)
                record = tensor.record if tensor is not None else None
                if record is not None:
                    ranges.append((self.rank_files[block.rank], record.offset, record.length))
        return ranges

    def open(self) -> "FsdpSource":
        """A reader of the global tensors' rows, out of the rank files this index loaded."""
        from mergeflow.formats.fsdp.reader import FsdpSource

        return FsdpSource(self)


@contextlib.contextmanager
def _quiet_device_mesh() -> Iterator[None]:
    """Silence DeviceMesh's warning that it is unpickled without process groups (expected here)."""
    mesh_logger = logging.getLogger("torch.distributed.device_mesh")
    level = mesh_logger.level
    mesh_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        mesh_logger.setLevel(level)


def load_rank_state(path: str | Path) -> dict[str, RankTensor]:
    """Memory-map one rank file: each entry's metadata, its local data left on disk until read.

    The pickle is read by `mergeflow.rank_pickle`, which runs nothing from it; one that reader does not
    know is loaded with `torch.load(weights_only=True)` instead.

    Raises:
        CheckpointError: the file is truncated, not a torch checkpoint, not a state dict, its pickle
            does not match its CRC-32, or it asks for globals other than tensors (it is refused, never
            executed). Tensor data is checked against its CRC-32 as it is read (`RankReader`).
    """
    path = Path(path)
    if not zipfile.is_zipfile(path):
        raise no_zip_directory(path)
    try:
        state = read_rank_pickle(path)
    except UnknownPickle:
        state = _load_with_torch(path)
    except zipfile.BadZipFile as e:
        raise CheckpointError(f"corrupt rank file {path}: {e}", hint=CORRUPT_HINT) from e
    except (pickle.UnpicklingError, OSError, EOFError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e
    return {_strip_wrappers(key): value for key, value in state.items()}


def _load_with_torch(path: Path) -> dict[str, RankTensor]:
    import torch.distributed.tensor  # DTensor pickles name its classes

    try:
        with _quiet_device_mesh():
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"refusing to load {path}: its pickle needs code that is not a tensor ({_unpickling_reason(e)}). "
            "mergeflow loads checkpoints with weights_only=True and never executes code from them."
        ) from e
    except (RuntimeError, OSError, EOFError, ValueError, KeyError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e
    if not isinstance(state, Mapping):
        raise CheckpointError(f"not a model state dict: {path} holds a {type(state).__name__}")
    not_tensors = [str(key) for key, value in state.items() if not isinstance(value, torch.Tensor)]
    if not_tensors:
        raise CheckpointError(f"not a model state dict: {path} has non-tensor entries {quoted(not_tensors)}")
    tensors = {str(key): _rank_tensor(value, str(key), path) for key, value in state.items()}
    located = tensor_file_offsets(path, {key: value.local for key, value in tensors.items()})
    return {
        key: dataclasses.replace(value, file_offset=located[key][0], record=located[key][1]) if key in located else value
        for key, value in tensors.items()
    }


def _rank_tensor(tensor: torch.Tensor, name: str, path: Path) -> RankTensor:
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return RankTensor(tensor, tuple(tensor.shape), tensor.dtype)
    try:
        coordinate = tensor.device_mesh.get_coordinate()
    except AttributeError:  # a mesh pickled by a torch that did not record the saving rank's position
        coordinate = None
    if coordinate is None:
        raise CheckpointError(f'tensor "{name}" in {path} is on a device mesh that does not hold the rank that saved it')
    mesh = MeshPosition(tuple(tensor.device_mesh.shape), tensor.device_mesh.mesh_dim_names, tuple(coordinate))
    return RankTensor(
        tensor._local_tensor, tuple(tensor.shape), tensor.dtype, _placement_names(tensor, name, path), mesh
    )


def _unpickling_reason(error: pickle.UnpicklingError) -> str:
    for line in str(error).splitlines():
        if "GLOBAL" in line or "Unsupported" in line:
            return line.strip().rstrip(".")
    return str(error).splitlines()[0]


def _strip_wrappers(key: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        key = key.replace(prefix, "")
    return key


class LoadedRanks:
    """The rank files' states as `index_shards` loaded them (memory-mapped), for the readers of the same
    merge: unpickling every rank file once to plan and again to copy would cost seconds on large
    checkpoints. A file changed since is loaded again; pickled (for a worker process), it is empty."""

    def __init__(self, states: dict[str, tuple[tuple[int, int], dict[str, RankTensor]]] | None = None):
        self._states = states or {}

    @classmethod
    def of(cls, rank_files: RankFiles, states: list[dict[str, RankTensor]]) -> "LoadedRanks":
        return cls({path: (_file_identity(path), state) for path, state in zip(rank_files.paths, states, strict=True)})

    def state(self, path: str) -> dict[str, RankTensor]:
        """The rank file's state: as loaded, or loaded now."""
        identity, state = self._states.get(path, (None, None))
        if state is not None and identity == _file_identity(path):
            return state
        return load_rank_state(path)

    def __reduce__(self):
        return LoadedRanks, ()


def _file_identity(path: str) -> tuple[int, int]:
    stat = os.stat(path)
    return stat.st_size, stat.st_mtime_ns


def index_shards(rank_files: RankFiles) -> ShardIndex:
    """Read every rank's metadata and work out which blocks make up each global tensor.

    Raises:
        CheckpointError: ranks disagree on keys, shapes, dtypes or mesh; a placement is not
            supported; local shapes do not match the placements; plain tensors differ across ranks.
    """
    states = [load_rank_state(path) for path in rank_files.paths]
    names = list(states[0])
    _check_same_keys(states, rank_files)
    mesh_shape, mesh_dim_names, experts = _meshes_of(states, rank_files)
    tensors = {name: _source_tensor(name, states, rank_files, experts) for name in names}
    return ShardIndex(
        checkpoint_dir=rank_files.checkpoint_dir,
        world_size=rank_files.world_size,
        rank_files=rank_files.paths,
        mesh_shape=mesh_shape,
        mesh_dim_names=mesh_dim_names,
        tensors=tensors,
        aliases=_storage_aliases(states[0]),
        fsdp_version=rank_files.fsdp_version,
        expert_parallel=experts.size if experts else 1,
        loaded=LoadedRanks.of(rank_files, states),
    )


def _check_same_keys(states: list[dict[str, RankTensor]], rank_files: RankFiles) -> None:
    expected = set(states[0])
    for rank, state in enumerate(states[1:], start=1):
        missing, extra = expected - set(state), set(state) - expected
        if missing or extra:
            details = "; ".join(
                part
                for part in (
                    f"missing {quoted(missing)}" if missing else "",
                    f"extra {quoted(extra)}" if extra else "",
                )
                if part
            )
            raise CheckpointError(
                f"rank files disagree on keys: {rank_files.paths[rank]} vs rank 0: {details}"
            )


def _meshes_of(
    states: list[dict[str, RankTensor]], rank_files: RankFiles
) -> tuple[tuple[int, ...], tuple[str, ...] | None, ExpertSplit | None]:
    """The device mesh every DTensor uses, checked against the world size and the ranks' positions in it; and, for
    a VeOmni checkpoint with expert parallelism, how its expert tensors (on a mesh of their own) are split."""
    if not any(tensor.mesh is not None for state in states for tensor in state.values()):
        return (rank_files.world_size,), None, None
    meshes = {tensor.mesh.key for state in states for tensor in state.values() if tensor.mesh is not None}
    expert_meshes = {mesh for mesh in meshes if is_expert_mesh(mesh[1])}
    dense_meshes = meshes - expert_meshes
    if len(dense_meshes) != 1 or len(expert_meshes) > 1:
        shapes = ", ".join(sorted(f"{shape} {names}" for shape, names in meshes))
        raise CheckpointError(f"tensors of {rank_files.checkpoint_dir} use different device meshes: {shapes}")
    (shape, names), = dense_meshes
    _check_dense_mesh(shape, names, _positions_on((shape, names), states, rank_files), rank_files)
    if not expert_meshes:
        return shape, names, None
    (expert_mesh,) = expert_meshes
    positions = _positions_on(expert_mesh, states, rank_files)
    return shape, names, expert_split(next(p for p in positions if p is not None), positions, rank_files)


def _positions_on(
    mesh: tuple[tuple[int, ...], tuple[str, ...] | None], states: list[dict[str, RankTensor]], rank_files: RankFiles
) -> list[MeshPosition | None]:
    """Each rank's position on `mesh` (shape and dim names), as its DTensors on that mesh record it."""
    positions = []
    for state, path in zip(states, rank_files.paths, strict=True):
        on_mesh = {tensor.mesh for tensor in state.values() if tensor.mesh and tensor.mesh.key == mesh}
        if len(on_mesh) > 1:
            raise CheckpointError(f"the DTensors of {path} disagree on the rank's mesh position")
        positions.append(next(iter(on_mesh), None))
    return positions


def _check_dense_mesh(
    shape: tuple[int, ...], names: tuple[str, ...] | None, positions: list[MeshPosition | None], rank_files: RankFiles
) -> None:
    if names is not None and not set(names) <= SUPPORTED_MESH_DIM_NAMES:
        raise CheckpointError(
            f"unsupported device mesh dims {names} in {rank_files.paths[0]}: mergeflow merges FSDP/HSDP meshes "
            f"with dims named {quoted(SUPPORTED_MESH_DIM_NAMES)}"
        )
    if math.prod(shape) != rank_files.world_size:
        raise CheckpointError(
            f"device mesh {shape} of {rank_files.paths[0]} holds {math.prod(shape)} ranks, "
            f"but the checkpoint has world_size={rank_files.world_size}"
        )
    for rank, position in enumerate(positions):
        if position is None:
            raise CheckpointError(f"{rank_files.paths[rank]} holds no DTensors, but other ranks of the checkpoint do")
    if len({position.coordinate for position in positions}) != len(positions):
        raise CheckpointError(f"two rank files of {rank_files.checkpoint_dir} hold the same mesh position")


def _placement_names(tensor, name: str, path: Path) -> tuple[str, ...]:
    """A torch-loaded DTensor's placements as `placement` names."""
    from torch.distributed.tensor import Replicate, Shard

    names = []
    for placement in tensor.placements:
        if type(placement) is Shard:
            names.append(shard(placement.dim))
        elif type(placement) is Replicate:
            names.append(REPLICATE)
        else:
            raise CheckpointError(
                f'unsupported placement {placement} of tensor "{name}" in {path}: '
                "mergeflow merges Shard(dim) and Replicate placements only"
            )
    return tuple(names)


def _source_tensor(
    name: str,
    states: list[dict[str, RankTensor]],
    rank_files: RankFiles,
    experts: ExpertSplit | None,
) -> SourceTensor:
    first = states[0][name]
    if not first.is_dtensor:
        return _replicated_plain_tensor(name, states, rank_files)
    split = experts if first.mesh is not None and is_expert_mesh(first.mesh.dim_names) else None
    shape = split.full_shape(first.shape) if split else first.shape
    blocks = []
    for rank, state in enumerate(states):
        tensor, path = state[name], rank_files.paths[rank]
        if not tensor.is_dtensor or tensor.shape != first.shape or tensor.dtype != first.dtype:
            raise CheckpointError(
                f'tensor "{name}" differs across ranks: {path} has {_describe(tensor)}, rank 0 has {_describe(first)}'
            )
        if tensor.placements != first.placements:
            raise CheckpointError(f'tensor "{name}" has different placements on {path} than on rank 0')
        if tensor.mesh.dim_names != first.mesh.dim_names:
            raise CheckpointError(f'tensor "{name}" is on a different device mesh in {path} than on rank 0')
        offset, local_shape = local_block(first.shape, tensor.mesh.shape, tensor.mesh.coordinate, first.placements)
        actual = tuple(tensor.local.shape)
        if actual != local_shape:
            raise CheckpointError(
                f'tensor "{name}" in {path} has local shape {actual}, expected {local_shape} for global shape '
                f"{first.shape} with placements {first.placements} on mesh {tensor.mesh.shape}"
            )
        blocks.append(Block(rank, split.offset(rank, first.shape, offset) if split else offset, local_shape))
    chosen = unique_blocks(blocks)
    if not covers_exactly(shape, chosen):
        raise CheckpointError(f'the rank blocks of tensor "{name}" do not cover its global shape {shape}')
    return SourceTensor(name, dtype_name(first.dtype), shape, first.placements, chosen)


def _replicated_plain_tensor(name: str, states: list[dict[str, RankTensor]], rank_files: RankFiles) -> SourceTensor:
    """A plain tensor (buffer, or world size 1) must be the same on every rank; it is kept once."""
    first = states[0][name]
    for rank, state in enumerate(states[1:], start=1):
        other = state[name]
        if other.is_dtensor or other.shape != first.shape or other.dtype != first.dtype:
            raise CheckpointError(
                f'tensor "{name}" differs across ranks: {rank_files.paths[rank]} has {_describe(other)}, '
                f"rank 0 has {_describe(first)}"
            )
        if not torch.equal(other.local, first.local):
            raise CheckpointError(
                f'plain tensor "{name}" has different values in {rank_files.paths[rank]} than on rank 0; '
                "a tensor that is not a DTensor must be replicated"
            )
    return SourceTensor(name, dtype_name(first.dtype), first.shape, (), (Block(0, (0,) * len(first.shape), first.shape),))


def _describe(tensor: RankTensor) -> str:
    kind = "DTensor" if tensor.is_dtensor else "tensor"
    return f"{kind} {tensor.shape} {dtype_name(tensor.dtype)}"


def _storage_aliases(state: dict[str, RankTensor]) -> dict[str, str]:
    """Names whose local data is the same memory as an earlier name's (tied weights saved once)."""
    first_name: dict[tuple, str] = {}
    aliases = {}
    for name, tensor in state.items():
        local = tensor.local
        if local.numel() == 0:
            continue
        key = (local.data_ptr(), tuple(local.shape), local.stride())
        if key in first_name:
            aliases[name] = first_name[key]
        else:
            first_name[key] = name
    return aliases
