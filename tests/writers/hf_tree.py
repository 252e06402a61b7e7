"""Checkpoints that already hold a Hugging Face model, laid out as verl saves them, the tree in each the real
`save_pretrained` output of an FSDP fixture's model (its reference). The layouts are derived from verl's source:
`FSDPCheckpointManager.save_checkpoint` with `save_contents=["hf_model"]` saves the model with `save_pretrained`
into `huggingface/` beside the tokenizer; the Automodel engine (`workers/engine/automodel`) saves HF-named shards in
`model/`, the loadable model in `model/consolidated/` and the optimizer's DCP in `optim/`. Both writers run here, in
venvs of their own (`tests/test_veomni.py` checks an `hf_model` save verl's manager wrote, `tests/test_automodel.py`
one nemo-automodel's checkpointer wrote); these derived trees cover cheaply the cases that damage a tree or only look
at its layout (the watcher, `inspect`)."""

import shutil
from pathlib import Path

from mergeflow.demo.fsdp import Fixture
from mergeflow.formats.verl_run import TRACKER_FILE


def hf_model_only(fixture: Fixture, run_dir: Path, step: int = 1) -> Path:
    """`run/global_step_N/actor` as verl's FSDP manager saves it with `save_contents=["hf_model"]`: the model and its
    tokenizer in `huggingface/`, and no rank files."""
    checkpoint = run_dir / f"global_step_{step}" / "actor"
    shutil.copytree(fixture.checkpoint_dir / "huggingface", checkpoint / "huggingface")
    for weights in fixture.reference_dir.glob("*.safetensors"):
        shutil.copyfile(weights, checkpoint / "huggingface" / weights.name)
    (run_dir / TRACKER_FILE).write_text(str(step))
    return checkpoint


def automodel(fixture: Fixture, run_dir: Path, step: int = 1) -> Path:
    """`run/global_step_N/actor` as verl's Automodel engine saves it: HF-named shards in `model/`, the loadable model
    (config, weights, no tokenizer) in `model/consolidated/`, the optimizer's DCP in `optim/`."""
    checkpoint = run_dir / f"global_step_{step}" / "actor"
    consolidated = checkpoint / "model" / "consolidated"
    consolidated.mkdir(parents=True)
    for path in fixture.reference_dir.iterdir():
        if path.suffix == ".safetensors" or path.name in ("config.json", "generation_config.json"):
            shutil.copyfile(path, consolidated / path.name)
            if path.suffix == ".safetensors":
                shutil.copyfile(path, checkpoint / "model" / f"shard-00001-{path.name}")
    (checkpoint / "optim").mkdir()
    (checkpoint / "optim" / ".metadata").write_bytes(b"")
    (run_dir / TRACKER_FILE).write_text(str(step))
    return checkpoint
