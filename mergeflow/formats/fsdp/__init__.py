"""verl's FSDP checkpoints: one `torch.save` pickle of DTensor shards per rank."""

from mergeflow.formats.backend import Backend
from mergeflow.formats.fsdp.layout import detect, find_rank_files, is_training_file

BACKEND = Backend(
    name="fsdp",
    description="rank files of verl's FSDP engines (model_world_size_W_rank_R.pt)",
    find=find_rank_files,
    recognises=detect,
    is_training_file=is_training_file,
    needs_spec=False,
)
