"""Threads, Dask and Ray side by side: `mergeflow merge` of one checkpoint on each task runner, and where the time goes.

    python -m bench.runners --workdir /data/mergeflow-bench [--model qwen2.5-1.5b] [--rounds 2]
                            [--max-shard-size 1GB] [--json bench/results/runners.json]

Each run is `mergeflow merge --task-runner SPEC` in a fresh process against a running Prefect server, from a cold
page cache with the config's spec remembered, into weight files of `--max-shard-size` (several, so the writes can
spread). The runners: `threads` (the default), `dask` (a local Dask cluster started for the run), `ray` (a local
Ray started for the run) and `ray:ADDRESS`, a Ray cluster of two nodes on 127.0.0.1 (`ray start`, one CPU each)
that the bench starts once and times apart. Each run's time is split by the server's record of its flow run:
startup (the process until the flow run starts), the task runner's start (until the first task starts: the
cluster, for a Dask or Ray started for the run), preparing (to the end of the last step before the writes),
submission (from there to the first write's start), the writes (first start to last end), and after the writes
(validation, the model card, publication, the process's exit). The runs rotate by one place each round; the I/O
floor is sampled after each run; the outputs are compared with the threads run's, tensor by tensor.
"""

import argparse
import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from bench.chart import floor_seconds, median
from bench.make_checkpoint import write_checkpoint
from bench.run import (
    WORLD_SIZE,
    identical_outputs,
    io_floor,
    median_floor,
    output_bytes,
    run_job,
    running_prefect_server,
    shard_files,
    store_spec,
)

MODEL = "qwen2.5-1.5b"
ROUNDS = 2
MAX_SHARD_SIZE = "1GB"
RUNNERS = ("threads", "dask", "ray", "ray cluster")
PHASES = ("startup", "runner_start", "preparing", "submission", "writes", "after_writes")
WRITE_TASK_KEY = "write_shard"
"""How the write task's runs' keys begin (the function's name, then a hash of its code)."""


def flow_run_phases(api_url: str, started: float, ended: float) -> dict[str, float]:
    """The latest flow run's time split into `PHASES`, in seconds, from its task runs' start and end times and the
    `mergeflow merge` process's start and end (`started`, `ended`)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import FlowRunSort
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        flow_run = client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1)[0]
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))
    writes = [run for run in task_runs if run.task_key.startswith(WRITE_TASK_KEY)]
    first_write = min(run.start_time.timestamp() for run in writes)
    last_write = max(run.end_time.timestamp() for run in writes)
    first_task = min(run.start_time.timestamp() for run in task_runs if run.start_time)
    prepared = max(
        (run.end_time.timestamp() for run in task_runs if run.end_time and run.end_time.timestamp() <= first_write),
        default=first_task,
    )
    flow_start = flow_run.start_time.timestamp()
    return {
        "startup": flow_start - started,
        "runner_start": first_task - flow_start,
        "preparing": prepared - first_task,
        "submission": first_write - prepared,
        "writes": last_write - first_write,
        "after_writes": ended - last_write,
    }


def runner_spec(runner: str, cluster_address: str) -> str:
    return f"ray:{cluster_address}" if runner == "ray cluster" else runner


def bench_runners(workdir: Path, model: str, rounds: int, max_shard_size: str, server_url: str, cluster) -> dict:
    """`rounds` rounds of one cold run per runner, rotated; the I/O floor after each run."""
    checkpoint_dir = workdir / "checkpoints" / model
    if len(shard_files(checkpoint_dir)) != WORLD_SIZE:
        print(f"writing {model} checkpoint ({WORLD_SIZE} ranks, fp32) ...", flush=True)
        shutil.rmtree(checkpoint_dir, ignore_errors=True)
        write_checkpoint(model, WORLD_SIZE, checkpoint_dir)
    spec_cache = workdir / "spec-cache-seen"
    shutil.rmtree(spec_cache, ignore_errors=True)
    store_spec(checkpoint_dir, spec_cache)
    outputs = workdir / "outputs"
    reference = outputs / f"{model}-threads-reference"
    environment = {**os.environ, "PREFECT_API_URL": server_url}
    runs, floors = [], []
    for round_number in range(1, rounds + 1):
        shift = (round_number - 1) % len(RUNNERS)
        for runner in RUNNERS[shift:] + RUNNERS[:shift]:
            target = reference if runner == "threads" and not reference.exists() else outputs / f"{model}-{runner.replace(' ', '-')}"
            print(f"{model}: round {round_number}, --task-runner {runner} ...", flush=True)
            flags = ("--task-runner", runner_spec(runner, cluster.address), "--max-shard-size", max_shard_size)
            run = run_job("cli", checkpoint_dir, target, cold=True, spec_cache=spec_cache, environment=environment, flags=flags)
            phases = flow_run_phases(server_url, run["started_at"], run["ended_at"])
            identical = target == reference or identical_outputs(reference, target)
            if target != reference:
                shutil.rmtree(target, ignore_errors=True)
            runs.append({"round": round_number, "runner": runner, "identical": identical, **run, **phases})
            floors.append(io_floor(checkpoint_dir, output_bytes(reference), outputs / "floor.bin"))
    shutil.rmtree(reference, ignore_errors=True)
    return {"model": model, "max_shard_size": max_shard_size, **median_floor(floors), "floor_samples": floors,
            "runs": runs}  # fmt: skip


def table(result: dict, cluster_start_seconds: float) -> str:
    floor = floor_seconds(result)
    header = ("runner", "wall s", "vs floor", *(phase.replace("_", " ") for phase in PHASES), "peak RSS GB", "identical")
    rows = [header]
    for runner in RUNNERS:
        runs = [run for run in result["runs"] if run["runner"] == runner]
        wall = median([run["wall_seconds"] for run in runs])
        rows.append((
            f"{runner} ({runner_spec(runner, 'HEAD:PORT')})", f"{wall:.1f}", f"{wall / floor:.2f}x",
            *(f"{median([run[phase] for run in runs]):.1f}" for phase in PHASES),
            f"{max(run['peak_rss_bytes'] for run in runs) / 1e9:.2f}", str(all(run["identical"] for run in runs)),
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [" | ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "-+-".join("-" * width for width in widths))
    return "\n".join([
        f"{result['model']}, {WORLD_SIZE} ranks fp32 -> bf16 in {result['max_shard_size']} files, cold page cache, "
        f"running Prefect server; medians of {len(runs)} rounds; I/O floor {floor:.1f} s; "
        f"the two-node Ray cluster started in {cluster_start_seconds:.1f} s (not in its rows)",
        *lines,
        "peak RSS: the mergeflow process and the children it waited for (not Dask's or Ray's worker processes)",
    ])  # fmt: skip


@contextlib.contextmanager
def two_node_ray_cluster(environment: dict[str, str]) -> Iterator[tuple[object, float]]:
    """A head and a worker node on 127.0.0.1 (`tests.ray_cluster`), and the seconds they took to start."""
    from tests.ray_cluster import LocalRayCluster

    temp_dir = Path(tempfile.mkdtemp(prefix="mf-bench-ray-"))
    cluster = LocalRayCluster(temp_dir, env=environment)
    started = time.perf_counter()
    try:
        cluster.start(worker_nodes=1)
        yield cluster, time.perf_counter() - started
    finally:
        cluster.stop()
        shutil.rmtree(temp_dir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--max-shard-size", default=MAX_SHARD_SIZE)
    parser.add_argument("--json", type=Path, default=Path("bench/results/runners.json"))
    args = parser.parse_args()
    os.environ["PREFECT_HOME"] = str(args.workdir / "prefect-home")
    os.environ.update(PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1", RAY_USAGE_STATS_ENABLED="0")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # else a local Ray writes a token to ~/.ray (the bench's is on 127.0.0.1)
    for variable in ("PREFECT_API_URL", "RAY_ADDRESS"):
        os.environ.pop(variable, None)
    with running_prefect_server(args.workdir / "prefect-server.log") as server_url:
        cluster_environment = {**os.environ, "PREFECT_API_URL": server_url, "PYTHONPATH": str(Path.cwd())}
        with two_node_ray_cluster(cluster_environment) as (cluster, cluster_start_seconds):
            result = bench_runners(args.workdir, args.model, args.rounds, args.max_shard_size, server_url, cluster)
    result["ray_cluster_start_seconds"] = cluster_start_seconds
    print(table(result, cluster_start_seconds))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"\nwritten: {args.json}")


if __name__ == "__main__":
    main()
