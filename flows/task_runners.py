"""Where the per-shard merge tasks run: threads in this process, or a Dask cluster (shared filesystem needed)."""

from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

from mergeflow.errors import OptionError

DEFAULT_THREADS = 2
DEFAULT_DASK_WORKERS = 2


def task_runner_from(spec: str) -> TaskRunner:
    """`threads[:N]`, `dask[:N]` (a LocalCluster of N single-threaded worker processes) or
    `dask://HOST:PORT` (an existing cluster's scheduler)."""
    kind, _, argument = spec.partition(":")
    if kind == "threads":
        return ThreadPoolTaskRunner(max_workers=_count(spec, argument, DEFAULT_THREADS))
    if kind == "dask" and argument.startswith("//"):
        return _dask(address=f"tcp:{argument}")
    if kind == "dask":
        workers = _count(spec, argument, DEFAULT_DASK_WORKERS)
        return _dask(cluster_kwargs={"n_workers": workers, "threads_per_worker": 1, "processes": True})
    raise OptionError(f"task runner '{spec}': use threads[:N], dask[:N] or dask://HOST:PORT")


def _count(spec: str, argument: str, default: int) -> int:
    if not argument:
        return default
    if not argument.isdigit() or int(argument) < 1:
        raise OptionError(f"task runner '{spec}': '{argument}' is not a positive number of workers")
    return int(argument)


def _dask(**options) -> TaskRunner:
    try:
        from prefect_dask import DaskTaskRunner
    except ImportError as e:
        raise OptionError("a Dask task runner needs prefect-dask: pip install 'mergeflow[dask]'") from e
    return DaskTaskRunner(**options)
