"""VeOmni checkpoints, saved by VeOmni and verl themselves on CPU (gloo) in a venv of their own
(`tests.side_venvs.VEOMNI`: VeOmni 0.1.12 targets transformers 5.9): the model built and sharded as verl's VeOmni
engine builds it, saved by verl's own `FSDPCheckpointManager` (`tests.writers.veomni_worker`). No training step: the
checkpoint holds the reference model's weights, so that a merge must give them back bit for bit (under expert
parallelism VeOmni's eager experts could not run a forward anyway)."""

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from mergeflow.demo.fsdp import run_ranks
from mergeflow.demo.models import tiny_config, tiny_model, tiny_tokenizer
from mergeflow.formats.verl_run import TRACKER_FILE

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class VeomniFixtureSpec:
    """One VeOmni checkpoint: the tiny model, the world size, and VeOmni's expert-parallel and Ulysses sizes."""

    name: str
    model: str = "qwen3_moe"
    world_size: int = 2
    expert_parallel: int = 2
    ulysses: int = 1
    replicas: int = 1
    """HSDP: data-parallel replicas of the sharded model (verl's `fsdp_size` below the data-parallel size)."""
    save_contents: tuple[str, ...] = ("model", "extra")
    """verl's `checkpoint.save_contents`: `("hf_model",)` saves the Hugging Face model in `huggingface/` alone."""
    step: int = 1


@dataclass(frozen=True)
class VeomniFixture:
    spec: VeomniFixtureSpec
    reference_dir: Path
    """The original model, saved with save_pretrained (and loaded by VeOmni from there)."""
    run_dir: Path
    checkpoint_dir: Path
    """`<run>/global_step_N/actor`: what a user passes as --local_dir."""


def veomni_fixture_at(spec: VeomniFixtureSpec, root: Path) -> VeomniFixture:
    """Where `write_veomni_fixtures(..., root)` writes the spec's checkpoint."""
    run_dir = Path(root) / spec.name / "run"
    return VeomniFixture(spec, Path(root) / spec.name / "reference", run_dir, run_dir / f"global_step_{spec.step}" / "actor")


def write_veomni_fixtures(specs: list[VeomniFixtureSpec], root: Path, *, python: Path) -> None:
    """Each spec's reference model and checkpoint, one launch of its ranks per spec (VeOmni's parallel state is
    one per process)."""
    for spec in specs:
        fixture = veomni_fixture_at(spec, root)
        model = tiny_model(tiny_config(spec.model, tie=False), seed=0, dtype=torch.float32)
        model.save_pretrained(fixture.reference_dir)
        tiny_tokenizer().save_pretrained(fixture.reference_dir)
        job = {
            **asdict(spec),
            "reference_dir": str(fixture.reference_dir),
            "checkpoint_dir": str(fixture.checkpoint_dir),
        }
        job_file = Path(root) / f"{spec.name}.json"
        job_file.write_text(json.dumps(job))
        run_ranks(spec.world_size, job_file, "tests.writers.veomni_worker", import_root=REPO, python=python)
        (fixture.run_dir / TRACKER_FILE).write_text(str(spec.step))
