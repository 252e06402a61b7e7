"""Where the per-shard write tasks run: threads in this process, a Dask cluster or a Ray cluster (the last two
need a filesystem every worker sees at the same paths).

`parse_task_runner` and `check_task_runner` check a spec without importing Prefect, Dask or Ray, so the CLI answers
a bad one at once."""

import contextlib
import importlib.util
import os
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING

from mergeflow.errors import OptionError

if TYPE_CHECKING:
    from prefect.task_runners import TaskRunner

DEFAULT_THREADS = 2
DEFAULT_DASK_WORKERS = 2
SPEC_HELP = "threads[:N], dask[:N], dask://HOST:PORT, ray, ray:HOST:PORT or ray://HOST:PORT"
RAY_ADDRESS_VARIABLE = "RAY_ADDRESS"
CONNECT_TIMEOUT_SECONDS = 5.0
WRITE_TASK_CPUS = 1
"""Ray CPUs one weight-file write holds: a node started with `--num-cpus=K` writes at most K files at once."""
WRITE_TASK_BASE_MEMORY = 768 * 1024**2
"""Ray memory one write holds besides its chunks: a worker process with torch, Prefect and the checkpoint's index."""
WRITE_TASK_CHUNKS = 3
"""Chunks one write holds at once: the one being written, the one read ahead, and the one being read."""
RAY_EXTRA_MISSING = "the Ray task runner needs prefect-ray: pip install 'mergeflow[ray]'"


def parse_task_runner(spec: str) -> tuple[str, int | str | None]:
    """`threads[:N]` -> ("threads", N), `dask[:N]` -> ("dask", N), `dask://HOST:PORT` -> ("dask", "tcp://HOST:PORT"),
    `ray` -> ("ray", None), `ray:HOST:PORT` -> ("ray", "HOST:PORT"), `ray://HOST:PORT` -> ("ray", "ray://HOST:PORT").

    Raises:
        OptionError: a spec of another form, or a count that is not a positive number.
    """
    kind, _, argument = spec.partition(":")
    if kind == "dask" and argument.startswith("//"):
        return kind, f"tcp:{argument}"
    if kind in ("threads", "dask"):
        return kind, _count(spec, argument, DEFAULT_THREADS if kind == "threads" else DEFAULT_DASK_WORKERS)
    if kind == "ray":
        if argument.startswith("//"):
            return kind, f"ray:{argument}"
        return kind, argument or None
    raise OptionError(f"task runner '{spec}': use {SPEC_HELP}")


def check_task_runner(spec: str) -> None:
    """Check a spec's form and, for Ray, that the integration is installed and the cluster (the spec's address,
    else RAY_ADDRESS's) takes connections.

    Raises:
        OptionError: a spec of another form, prefect-ray is not installed, or the cluster's address does not answer.
    """
    kind, address = parse_task_runner(spec)
    if kind != "ray":
        return
    if importlib.util.find_spec("prefect_ray") is None:
        raise OptionError(RAY_EXTRA_MISSING)
    address = address or os.environ.get(RAY_ADDRESS_VARIABLE)
    if not address or address in ("auto", "local"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise OptionError(f"Ray address '{address}': use HOST:PORT or ray://HOST:PORT")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_SECONDS).close()
    except OSError as e:
        raise OptionError(
            f"the Ray cluster at {address} does not answer ({e.strerror or e})",
            hint="start it with `ray start --head`, or check the address (the head's GCS port, or ray://HOST:10001 for Ray Client)",
        ) from e


def task_runner_from(spec: str) -> "TaskRunner":
    """The task runner of a `parse_task_runner` spec: a thread pool, a LocalCluster of single-threaded worker
    processes or an existing Dask cluster's scheduler, or Prefect's Ray task runner (on the address given, else
    on RAY_ADDRESS's cluster, else on a local Ray started for the run)."""
    from prefect.task_runners import ThreadPoolTaskRunner

    kind, argument = parse_task_runner(spec)
    if kind == "threads":
        return ThreadPoolTaskRunner(max_workers=argument)
    if kind == "ray":
        return _ray(argument)
    if isinstance(argument, str):
        return _dask(address=argument)
    return _dask(cluster_kwargs={"n_workers": argument, "threads_per_worker": 1, "processes": True})


def writes_in_process(spec: str) -> bool:
    """Whether the weight files are written by this process's threads (so a child may write them ahead)."""
    return parse_task_runner(spec)[0] == "threads"


@contextlib.contextmanager
def weight_file_task_resources(chunk_bytes: int) -> Iterator[None]:
    """Ray's resource request for each per-weight-file task (a write, or `test`'s comparison) submitted in the block:
    one CPU, and the memory of a worker holding `WRITE_TASK_CHUNKS` chunks, so a node is not handed more of them
    than its cores and memory take, spread over the nodes (Ray would fill the submitting node first); other task
    runners ignore it."""
    if importlib.util.find_spec("prefect_ray") is None:
        yield
        return
    from prefect_ray.context import remote_options

    memory = WRITE_TASK_BASE_MEMORY + WRITE_TASK_CHUNKS * chunk_bytes
    with remote_options(num_cpus=WRITE_TASK_CPUS, memory=memory, scheduling_strategy="SPREAD"):
        yield


def _count(spec: str, argument: str, default: int) -> int:
    if not argument:
        return default
    if not argument.isdigit() or int(argument) < 1:
        raise OptionError(f"task runner '{spec}': '{argument}' is not a positive number of workers")
    return int(argument)


def _dask(**options) -> "TaskRunner":
    try:
        from prefect_dask import DaskTaskRunner
    except ImportError as e:
        raise OptionError("a Dask task runner needs prefect-dask: pip install 'mergeflow[dask]'") from e
    return DaskTaskRunner(**options)


def _ray(address: str | None) -> "TaskRunner":
    if importlib.util.find_spec("prefect_ray") is None:
        raise OptionError(RAY_EXTRA_MISSING)
    from mergeflow.flows.ray_runner import RayTaskRunnerShutDownOnFailure

    if address is None and not os.environ.get(RAY_ADDRESS_VARIABLE):
        return RayTaskRunnerShutDownOnFailure(init_kwargs={"include_dashboard": False})
    return RayTaskRunnerShutDownOnFailure(address=address)
