"""Build a model spec in a child process, so a merge need not wait for it on its own core.

A spec for a config never seen imports transformers and the model's code: seconds of Python, which in
this process would hold the GIL the merge needs. A `SpecBuild` starts a child that builds the spec
into the spec cache while this process imports torch and reads the shards; a lookup of the same spec
here (`load_model_spec`) waits for that child instead of building it again. When the child fails, the
lookup builds the spec itself and reports the problem with its context. This module imports no torch.

    python -m mergeflow.spec.build CONFIG_DIR [--trust-remote-code] [--value-model]
"""

import argparse
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from mergeflow.spec import cache as spec_cache

if TYPE_CHECKING:
    from mergeflow.spec.model_spec import ModelSpec

PACKAGE_ROOT = Path(__file__).resolve().parents[1]

CHILD_NICENESS = 19
"""The child runs on the CPU the merge leaves idle: the spec is needed only once the weights are written."""

_running: dict[str, subprocess.Popen] = {}
"""The child last started for each spec key, so builds asked for while it runs join it."""
_running_lock = threading.Lock()


class SpecBuild:
    """The spec of one config directory, being built in a child process (or already cached: no child).

    A build of the same spec still running in this process (the CLI's warm-up's) is joined, not repeated.
    """

    def __init__(self, config_dir: Path, *, trust_remote_code: bool = False, is_value_model: bool = False):
        self.config_dir = Path(config_dir)
        self.trust_remote_code = trust_remote_code
        self.is_value_model = is_value_model
        self._key = spec_cache.model_spec_key(
            self.config_dir, trust_remote_code=trust_remote_code, is_value_model=is_value_model
        )
        self._process: subprocess.Popen | None = None
        if spec_cache.is_stored(self._key):
            return
        with _running_lock:
            running = _running.get(self._key)
            if running is None or running.poll() is not None:
                running = _running[self._key] = subprocess.Popen(
                    _child_command(self.config_dir, trust_remote_code, is_value_model),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    env=_child_environment(),
                )
        self._process = running
        spec_cache.build_elsewhere(self._key, self.wait)

    def done(self) -> bool:
        """Whether the spec can be looked up without waiting."""
        return self._process is None or self._process.poll() is not None

    def wait(self) -> None:
        if self._process is not None:
            self._process.wait()
        spec_cache.built_elsewhere(self._key)

    def spec(self, *, tie_word_embedding: bool = False) -> "ModelSpec":
        """The built spec (`mergeflow.spec.model_spec.load_model_spec`, which waits for the child)."""
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


def _child_environment() -> dict[str, str]:
    """This environment (the cache directory included), with mergeflow importable however it was found here."""
    environment = dict(os.environ)
    paths = [str(PACKAGE_ROOT), *filter(None, environment.get("PYTHONPATH", "").split(os.pathsep))]
    environment["PYTHONPATH"] = os.pathsep.join(paths)
    return environment


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__name__}", description="build a model spec into the cache"
    )
    parser.add_argument("config_dir", type=Path)
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--value-model", action="store_true")
    args = parser.parse_args(argv)
    os.nice(CHILD_NICENESS)
    from mergeflow.spec.model_spec import load_model_spec

    load_model_spec(
        args.config_dir, trust_remote_code=args.trust_remote_code, is_value_model=args.value_model
    )


if __name__ == "__main__":
    main()
