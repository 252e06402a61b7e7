"""verl's TorchTitan engine: torchtitan's own DCP archive (`global_step_N/step-N/`), read under Hugging Face names
through torchtitan's state-dict adapter mappings."""

from mergeflow.formats.backend import Backend
from mergeflow.formats.torchtitan.layout import find_torchtitan_checkpoint, is_training_file, recognises

BACKEND = Backend(
    name="torchtitan",
    description="a torchtitan archive of verl's TorchTitan engine (global_step_N/step-N/)",
    find=find_torchtitan_checkpoint,
    recognises=recognises,
    is_training_file=is_training_file,
    needs_spec=True,
)
