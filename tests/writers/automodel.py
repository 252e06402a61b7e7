"""Checkpoints of verl's Automodel engine, saved by nemo-automodel 0.7.0's own `Checkpointer` on CPU (gloo) in a venv
of its own (`tests.side_venvs.AUTOMODEL`: it pins transformers 5.18): `actor/model/` (HF-named shards),
`actor/model/consolidated/` (the loadable model, no tokenizer) and `actor/optim/` (DCP)."""

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from mergeflow.demo.fsdp import run_ranks
from mergeflow.demo.models import tiny_config, tiny_model, tiny_tokenizer
from mergeflow.formats.verl_run import TRACKER_FILE, step_dir_name

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class AutomodelFixtureSpec:
    name: str
    model: str = "qwen3"
    world_size: int = 2
    step: int = 1


@dataclass(frozen=True)
class AutomodelFixture:
    spec: AutomodelFixtureSpec
    reference_dir: Path
    """The original model, saved with save_pretrained: the run's model path, with the tokenizer."""
    run_dir: Path
    checkpoint_dir: Path
    """`<run>/global_step_N/actor`."""


def automodel_fixture_at(spec: AutomodelFixtureSpec, root: Path) -> AutomodelFixture:
    run_dir = Path(root) / spec.name / "run"
    return AutomodelFixture(spec, Path(root) / spec.name / "reference", run_dir, run_dir / step_dir_name(spec.step) / "actor")


def write_automodel_fixtures(specs: list[AutomodelFixtureSpec], root: Path, *, python: Path) -> None:
    for spec in specs:
        fixture = automodel_fixture_at(spec, root)
        tiny_model(tiny_config(spec.model, tie=True), seed=0, dtype=torch.float32).save_pretrained(fixture.reference_dir)
        tiny_tokenizer().save_pretrained(fixture.reference_dir)
        job = {
            "reference_dir": str(fixture.reference_dir),
            "checkpoint_dir": str(fixture.checkpoint_dir),
            "hf_home": str(Path(root) / spec.name / "hf-home"),
        }
        job_file = Path(root) / f"{spec.name}.json"
        job_file.write_text(json.dumps(job))
        run_ranks(spec.world_size, job_file, "tests.writers.automodel_worker", import_root=REPO, python=python)
        (fixture.run_dir / TRACKER_FILE).write_text(str(spec.step))
