"""The `mergeflow` command run as users run it: a fresh process, its exit code, output and wall time."""

import os
import subprocess
import sys
import time
from dataclasses import dataclass

COMMAND = [sys.executable, "-m", "mergeflow"]


@dataclass(frozen=True)
class CliRun:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]

    @property
    def last_line(self) -> str:
        lines = [line for line in self.stdout.splitlines() if line.strip()]
        return lines[-1] if lines else ""


def without_a_server() -> dict[str, str]:
    """The environment of a user who configured no Prefect server: `mergeflow` starts a temporary one."""
    return {name: value for name, value in os.environ.items() if name != "PREFECT_API_URL"}


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> CliRun:
    started = time.monotonic()
    done = subprocess.run(
        [*COMMAND, *map(str, args)], env=env or dict(os.environ), capture_output=True, text=True, timeout=timeout
    )
    return CliRun(done.returncode, done.stdout, done.stderr, time.monotonic() - started)
