"""Where the per-shard write tasks run: threads in this process, or a Dask cluster (shared filesystem needed).

`parse_task_runner` checks a spec without importing Prefect, so the CLI answers a bad one at once."""

from typing import TYPE_CHECKING

from mergeflow.errors import OptionError

if TYPE_CHECKING:
    from prefect.task_runners import TaskRunner

DEFAULT_THREADS = 2
DEFAULT_DASK_WORKERS = 2
SPEC_HELP = "threads[:N], dask[:N] or dask://HOST:PORT"


def parse_task_runner(spec: str) -> tuple[str, int | str]:
    """`threads[:N]` -> ("threads", N), `dask[:N]` -> ("dask", N), `dask://HOST:PORT` -> ("dask", "tcp://HOST:PORT").

    Raises:
        OptionError: a spec of another form, or a count that is not a positive number.
    """
    kind, _, argument = spec.partition(":")
    if kind == "dask" and argument.startswith("//"):
        return kind, f"tcp:{argument}"
    if kind in ("threads", "dask"):
        return kind, _count(spec, argument, DEFAULT_THREADS if kind == "threads" else DEFAULT_DASK_WORKERS)
    raise OptionError(f"task runner '{spec}': use {SPEC_HELP}")


def task_runner_from(spec: str) -> "TaskRunner":
    """The task runner of a `parse_task_runner` spec: a thread pool, a LocalCluster of single-threaded worker
    processes, or an existing cluster's scheduler."""
    from prefect.task_runners import ThreadPoolTaskRunner

    kind, argument = parse_task_runner(spec)
    if kind == "threads":
        return ThreadPoolTaskRunner(max_workers=argument)
    if isinstance(argument, str):
        return _dask(address=argument)
    return _dask(cluster_kwargs={"n_workers": argument, "threads_per_worker": 1, "processes": True})


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
