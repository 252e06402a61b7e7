"""VeOmni's expert parallelism in an FSDP checkpoint: each rank's stacked expert tensors hold only its expert-parallel
group's experts, under the shared key, split outside DTensor; within a group they are DTensors on a mesh of their
own (`ep_fsdp`, with `ep_replicate` under HSDP). Nothing in a tensor says which experts it holds: the group of a
rank follows from VeOmni's mesh, `(ep_replicate, ep_fsdp, ep)` with `ep` innermost, whose size is the world size
over the expert mesh's, and every rank's recorded position in the expert mesh is checked against that layout."""

import math
from dataclasses import dataclass

from mergeflow.errors import CheckpointError
from mergeflow.formats.fsdp.layout import RankFiles
from mergeflow.formats.fsdp.rank_pickle import MeshPosition

EXPERT_MESH_DIM_NAMES = frozenset({"ep_replicate", "ep_fsdp"})
EXPERT_DIM = 0
"""The dim of a stacked expert tensor that runs over experts (the one split across groups)."""


@dataclass(frozen=True)
class ExpertSplit:
    """How many expert-parallel groups the experts are split over, and the mesh each group's block is sharded on."""

    size: int
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...]

    def group_of(self, rank: int) -> int:
        """The expert-parallel group whose experts `rank` holds (VeOmni's `ep` mesh dim is innermost)."""
        return rank % self.size

    def position_of(self, rank: int) -> tuple[int, ...]:
        """Where `rank` sits in its group's expert mesh under VeOmni's layout."""
        index, position = rank // self.size, []
        for size in reversed(self.mesh_shape):
            index, coordinate = divmod(index, size)
            position.append(coordinate)
        return tuple(reversed(position))

    def full_shape(self, group_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape holding every group's experts, from the shape one group's tensor records."""
        return (group_shape[EXPERT_DIM] * self.size, *group_shape[EXPERT_DIM + 1 :])

    def offset(self, rank: int, group_shape: tuple[int, ...], block_offset: tuple[int, ...]) -> tuple[int, ...]:
        """A block's offset in the full tensor, from its offset in its group's tensor."""
        moved = list(block_offset)
        moved[EXPERT_DIM] += self.group_of(rank) * group_shape[EXPERT_DIM]
        return tuple(moved)


def is_expert_mesh(dim_names: tuple[str, ...] | None) -> bool:
    return dim_names is not None and "ep_fsdp" in dim_names and set(dim_names) <= EXPERT_MESH_DIM_NAMES


def expert_split(mesh: MeshPosition, positions: list[MeshPosition | None], rank_files: RankFiles) -> ExpertSplit:
    """The split of a checkpoint whose expert tensors are on `mesh`, given each rank's position in it.

    Raises:
        CheckpointError: the world size is not a whole number of expert meshes, a rank holds no expert tensors,
            or a rank's position in the expert mesh is not where VeOmni's layout puts it (its experts could not
            be placed).
    """
    ranks_per_group = math.prod(mesh.shape)
    if rank_files.world_size % ranks_per_group:
        raise CheckpointError(
            f"the expert mesh {mesh.shape} {mesh.dim_names} of {rank_files.paths[0]} does not divide the checkpoint's "
            f"world_size={rank_files.world_size}: cannot tell how many expert-parallel groups hold the experts"
        )
    split = ExpertSplit(rank_files.world_size // ranks_per_group, mesh.shape, mesh.dim_names)
    for rank, position in enumerate(positions):
        if position is None:
            raise CheckpointError(
                f"{rank_files.paths[rank]} holds no expert tensors on the {mesh.dim_names} mesh, but other ranks do"
            )
        if position.coordinate != split.position_of(rank):
            raise CheckpointError(
                f"the expert tensors of {rank_files.paths[rank]} sit at {position.coordinate} of the expert mesh "
                f"{mesh.shape} {mesh.dim_names}, where VeOmni's layout (expert parallel size {split.size}, innermost) "
                f"puts rank {rank} at {split.position_of(rank)}: cannot tell which experts it holds"
            )
    return split
