"""verl's Megatron checkpoints: megatron-core's torch_dist archive (PyTorch DCP), read under Hugging Face names
through each model family's record, or the Hugging Face weights mbridge saves."""

from mergeflow.formats.backend import Backend
from mergeflow.formats.megatron.layout import (
    find_megatron_checkpoint,
    is_complete,
    is_training_file,
    recognises,
)

BACKEND = Backend(
    name="megatron",
    description="a torch_dist archive of verl's Megatron engine (dist_ckpt/), or mbridge's Hugging Face weights",
    find=find_megatron_checkpoint,
    recognises=recognises,
    is_training_file=is_training_file,
    needs_spec=True,
    is_complete=is_complete,
)
