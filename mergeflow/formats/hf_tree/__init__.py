"""Checkpoints that already hold a Hugging Face model (verl's Automodel engine, FSDP saves of `hf_model` only):
copied, validated and published as a merge's output is."""

from mergeflow.formats.backend import Backend
from mergeflow.formats.hf_tree.layout import find_hf_tree, is_complete, is_training_file, recognises

BACKEND = Backend(
    name="hf",
    description="a Hugging Face model already (Automodel's model/consolidated/, or huggingface/ with its weights)",
    find=find_hf_tree,
    recognises=recognises,
    is_training_file=is_training_file,
    needs_spec=False,
    is_complete=is_complete,
)
