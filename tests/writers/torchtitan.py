"""TorchTitan checkpoints, saved by torchtitan 0.3.0's own checkpoint manager on CPU (gloo) in a venv of its own
(`tests.side_venvs.TORCHTITAN`; `tests.writers.torchtitan_worker` says what stands in for verl's engine). The
checkpoint holds the reference model's weights; its config is the reference's, passed as `--hf_model_config_path`
(verl's TorchTitan engine saves no `huggingface/`)."""

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from mergeflow.demo.fsdp import run_ranks
from mergeflow.demo.models import tiny_config, tiny_model, tiny_tokenizer
from mergeflow.formats.verl_run import TRACKER_FILE, step_dir_name

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class TorchTitanFixtureSpec:
    name: str
    model: str = "qwen3"
    tie: bool = True
    world_size: int = 2
    step: int = 1


@dataclass(frozen=True)
class TorchTitanFixture:
    spec: TorchTitanFixtureSpec
    reference_dir: Path
    """The original model, saved with save_pretrained: also the run's model path, where its config is."""
    run_dir: Path
    checkpoint_dir: Path
    """`<run>/global_step_N`, which holds torchtitan's `step-N/`: what a user passes as --local_dir."""


def torchtitan_fixture_at(spec: TorchTitanFixtureSpec, root: Path) -> TorchTitanFixture:
    run_dir = Path(root) / spec.name / "run"
    return TorchTitanFixture(spec, Path(root) / spec.name / "reference", run_dir, run_dir / step_dir_name(spec.step))


def write_torchtitan_fixtures(specs: list[TorchTitanFixtureSpec], root: Path, *, python: Path) -> None:
    """Each spec's reference model and checkpoint, by one launch of ranks for specs of one world size."""
    fixtures = [torchtitan_fixture_at(spec, root) for spec in specs]
    for fixture in fixtures:
        model = tiny_model(tiny_config(fixture.spec.model, tie=fixture.spec.tie), seed=0, dtype=torch.float32)
        model.save_pretrained(fixture.reference_dir)
        tiny_tokenizer().save_pretrained(fixture.reference_dir)
    for world_size in sorted({spec.world_size for spec in specs}):
        jobs = [
            {"reference_dir": str(fixture.reference_dir), "folder": str(fixture.checkpoint_dir), "step": fixture.spec.step}
            for fixture in fixtures
            if fixture.spec.world_size == world_size
        ]
        jobs_file = Path(root) / f"jobs_world_size_{world_size}.json"
        jobs_file.write_text(json.dumps(jobs))
        run_ranks(world_size, jobs_file, "tests.writers.torchtitan_worker", import_root=REPO, python=python)
    for fixture in fixtures:
        (fixture.run_dir / TRACKER_FILE).write_text(str(fixture.spec.step))
