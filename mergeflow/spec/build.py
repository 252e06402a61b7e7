"""Build a model spec in a child process, so that the merge need not wait for it on its own core.

A spec for a config never seen imports transformers and the model's code: seconds of Python, which in the
merge's process would hold the GIL the merge needs. A `SpecBuild` starts a child that builds the spec into
the spec cache, holding the entry's build lock, so a lookup of the same spec anywhere waits for the child
instead of building it again; when the child fails, the lookup builds the spec itself and reports the
problem with its context. Imports no torch.

    python -m mergeflow.spec.build CONFIG_DIR [--trust-remote-code] [--value-model]
"""

import argparse
import fcntl
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from mergeflow.perf import timeline
from mergeflow.perf.collector import paused_for_imports
from mergeflow.perf.fast_exit import exit_now
from mergeflow.spec import cache

if TYPE_CHECKING:
    from mergeflow.spec.model_spec import ModelSpec

PACKAGE_ROOT = Path(__file__).resolve().parents[2]


class SpecBuild:
    """The spec of one config directory, built in a child process unless it is cached or another builder
    already holds its build lock."""

    def __init__(self, config_dir: Path, *, trust_remote_code: bool = False, is_value_model: bool = False):
        self.config_dir = Path(config_dir)
        self.trust_remote_code = trust_remote_code
        self.is_value_model = is_value_model
        self.process: subprocess.Popen | None = None
        key = cache.model_spec_key(self.config_dir, trust_remote_code=trust_remote_code, is_value_model=is_value_model)
        if cache.is_stored(key):
            return
        with cache.open_build_lock(key) as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # being built elsewhere: a lookup waits for that build
                return
            self.process = subprocess.Popen(
                _child_command(self.config_dir, trust_remote_code, is_value_model),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=(lock.fileno(),),
                env=child_environment(),
            )
        # the child holds the lock (on the file description it inherited) until it exits

    def done(self) -> bool:
        """Whether the spec can be looked up without waiting for the child."""
        return self.process is None or self.process.poll() is not None

    def spec(self, *, tie_word_embedding: bool = False) -> "ModelSpec":
        """The built spec (`load_model_spec`, which waits for the child's lock)."""
        from mergeflow.spec.model_spec import load_model_spec  # imports torch

        return load_model_spec(
            self.config_dir,
            trust_remote_code=self.trust_remote_code,
            is_value_model=self.is_value_model,
            tie_word_embedding=tie_word_embedding,
        )


def _child_command(config_dir: Path, trust_remote_code: bool, is_value_model: bool) -> list[str]:
    flags = ["--trust-remote-code"] * trust_remote_code + ["--value-model"] * is_value_model
    return [sys.executable, "-m", __name__, str(config_dir), *flags]


def child_environment() -> dict[str, str]:
    """This environment (the cache directory included), with mergeflow importable however it was found here."""
    environment = dict(os.environ)
    paths = [str(PACKAGE_ROOT), *filter(None, environment.get("PYTHONPATH", "").split(os.pathsep))]
    environment["PYTHONPATH"] = os.pathsep.join(paths)
    return environment


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__name__}", description="build a model spec into the cache")
    parser.add_argument("config_dir", type=Path)
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--value-model", action="store_true")
    args = parser.parse_args(argv)
    timeline.mark("command started", process="spec-build child")
    with paused_for_imports():  # the whole child: importing transformers and building the model on the meta device
        from mergeflow.spec.model_spec import store_model_spec

        store_model_spec(args.config_dir, trust_remote_code=args.trust_remote_code, is_value_model=args.value_model)
    timeline.mark("spec stored")


if __name__ == "__main__":
    main()
    exit_now(0)  # the build lock is released when this process ends: at once, not after its teardown
