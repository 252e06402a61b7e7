"""A merged model serves: vLLM's CPU build, in a venv of its own, loads a merge and gives each token of a
sequence the log-probability transformers gives it."""

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from tests import side_venvs
from tests.conftest import WIDE_SPEC
from tests.merging import merge_with_engine, model_class

pytestmark = pytest.mark.slow

TOKEN_IDS = [2, 5, 17, 33, 90, 7, 64, 12]
VLLM_TIMEOUT_SECONDS = 600
TOLERANCE = 1e-4
"""Largest log-probability difference allowed in float32 (measured: 6e-6)."""


@pytest.fixture(scope="session")
def vllm_python(request) -> Path:
    """Python of a venv holding vLLM's CPU build (`tests.side_venvs`)."""
    return side_venvs.python_of(side_venvs.VLLM, request)


def vllm_log_probs(python: Path, model_dir: Path, workdir: Path) -> torch.Tensor:
    """vLLM's scores, from a process group of its own: vLLM's engine processes can outlive the script, and
    are killed with it. The engine runs in the script's process (half the time of a separate engine process:
    15 s against 31 s here)."""
    scores, log = workdir / "vllm-scores.json", workdir / "vllm.log"
    with open(log, "w") as output:
        scoring = subprocess.Popen(
            [python, Path(__file__).with_name("vllm_score.py"), model_dir, json.dumps(TOKEN_IDS), scores],
            stdout=output,
            stderr=subprocess.STDOUT,
            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
            start_new_session=True,
        )
        try:
            returncode = scoring.wait(timeout=VLLM_TIMEOUT_SECONDS)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(scoring.pid, signal.SIGKILL)
    assert returncode == 0, log.read_text()[-3000:]
    return torch.tensor(json.loads(scores.read_text()))


def transformers_log_probs(model_dir: Path) -> torch.Tensor:
    model = model_class(model_dir).from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        log_probs = torch.log_softmax(model(torch.tensor([TOKEN_IDS])).logits[0], dim=-1)
    return log_probs[torch.arange(len(TOKEN_IDS) - 1), TOKEN_IDS[1:]]


def test_vllm_scores_a_merged_model_as_transformers_does(vllm_python, fixtures, tmp_path):
    target = tmp_path / "merged"
    merge_with_engine(fixtures[WIDE_SPEC.name].checkpoint_dir, target, dtype="fp32")

    gap = (vllm_log_probs(vllm_python, target, tmp_path) - transformers_log_probs(target)).abs().max()

    assert gap <= TOLERANCE, float(gap)
