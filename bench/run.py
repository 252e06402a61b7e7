"""Benchmark mergeflow against verl's merger on large verl-layout FSDP checkpoints, side by side.

    python -m bench.run --workdir /data/mergeflow-bench [--models qwen2.5-0.5b qwen2.5-1.5b qwen2.5-3b]
                        [--verl-models qwen2.5-0.5b qwen2.5-1.5b] [--json bench/results/bench.json] [--rounds 3]

For each model it writes (once, then reuses) an 8-rank fp32 checkpoint, runs each tool in a fresh
process with a cold and a warm page cache, and checks that mergeflow's and verl's outputs hold
identical tensors. mergeflow runs as its engine alone (`bench.job mergeflow`), the same without its
CRC-32 checks (what they cost), and as users run it: `mergeflow merge` end to end, with no Prefect server
configured (the command starts a temporary one) and against a running server (`prefect server start`,
started by the bench). It runs with an empty model-spec cache (a config it has not seen: the first
merge of a training run, which imports transformers and builds the model on the meta device), and with
the spec remembered, as for every later checkpoint of the run. The I/O floor (reading the shards from
a cold page cache, plus writing the output's size once, each the faster of through the page cache and
O_DIRECT: `io_floor`) is sampled after every run. All of it is
repeated for `--rounds` rounds, the order of the runs rotated by one place each round, so the disk's
drift over minutes (and a throttled disk's slowness after a burst) reaches every kind of run alike; the
table reports medians (against the floor: the median of each run's time over the floor sampled right after
it), and every run is in the JSON. After the rounds, three more CLI runs (running server, no server, a new
config) run with MERGEFLOW_TIMELINE set, and their timelines are printed (`bench.timeline`): when each
process started, the imports, the server, each task run's start and end, and the write-ahead child's reads
and writes.
verl 0.9.1 must be installed: `pip install --no-deps verl==0.9.1 omegaconf`.
"""

import argparse
import contextlib
import json
import mmap
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from bench.chart import draw, floor_seconds, median
from bench.make_checkpoint import write_checkpoint
from bench.timeline import read_moments, render
from mergeflow.perf.timeline import TIMELINE_VARIABLE
from mergeflow.spec.cache import CACHE_DIR_VARIABLE

MODELS = ["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b"]
VERL_MODELS = ["qwen2.5-0.5b", "qwen2.5-1.5b"]
"""verl holds every shard plus a bf16 copy in RAM: 3B (~19 GB) is too close to a 24 GB machine."""
WORLD_SIZE = 8
WRITE_BLOCK = 64 * 1024 * 1024
GB = 1e9
QUIET_SECONDS = 2.0
QUIET_TIMEOUT_SECONDS = 300.0
ROUNDS = 3


def shard_files(checkpoint_dir: Path) -> list[Path]:
    return sorted(checkpoint_dir.glob("model_world_size_*_rank_*.pt"))


def wait_for_quiet_disk(path: Path) -> None:
    """Wait until the device holding `path` has done no I/O for QUIET_SECONDS.

    Deleting the previous run's gigabytes on a filesystem mounted with `discard` (as this machine's
    is) starts discards that run for seconds afterwards and stall whatever is timed next; so do the
    write-back of buffered outputs. Each timed step starts on a quiet disk instead.
    """
    stat_file = Path(f"/sys/dev/block/{os.major(path.stat().st_dev)}:{os.minor(path.stat().st_dev)}/stat")
    if not stat_file.is_file():
        return
    os.sync()
    deadline = time.monotonic() + QUIET_TIMEOUT_SECONDS
    busy_ms, quiet_since = None, time.monotonic()
    while time.monotonic() < deadline:
        fields = stat_file.read_text().split()
        in_flight, io_ticks = int(fields[8]), int(fields[9])
        if in_flight or io_ticks != busy_ms:
            busy_ms, quiet_since = io_ticks, time.monotonic()
        elif time.monotonic() - quiet_since >= QUIET_SECONDS:
            return
        time.sleep(0.1)


def drop_page_cache(paths: list[Path]) -> None:
    """Evict files from the page cache (clean pages only: sync first)."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_page_cache(paths: list[Path]) -> None:
    subprocess.run(["cat", *map(str, paths)], stdout=subprocess.DEVNULL, check=True)


def io_floor(checkpoint_dir: Path, output_bytes: int, scratch: Path) -> dict[str, float]:
    """Seconds to read the shards from a cold page cache and to write `output_bytes` once, each the faster of two
    ways: through the page cache (`cat`; buffered writes, as cp does) and around it (O_DIRECT, in 64 MiB
    requests). On some disks one is several times the other (here, buffered writes ran at a fifth of O_DIRECT's
    speed), and the floor is what the disk can do."""
    shards = shard_files(checkpoint_dir)
    reads = {"cat": lambda: warm_page_cache(shards), "direct": lambda: read_direct(shards)}
    writes = {"buffered": lambda: write_buffered(scratch, output_bytes), "direct": lambda: write_direct(scratch, output_bytes)}
    timed = {}
    for way, read in reads.items():
        drop_page_cache(shards)
        wait_for_quiet_disk(checkpoint_dir)
        timed[f"read_{way}_seconds"] = seconds_of(read)
    for way, write in writes.items():
        wait_for_quiet_disk(checkpoint_dir)
        timed[f"write_{way}_seconds"] = seconds_of(write)
        scratch.unlink()
    wait_for_quiet_disk(checkpoint_dir)
    return {
        "read_seconds": min(timed["read_cat_seconds"], timed["read_direct_seconds"]),
        "write_seconds": min(timed["write_buffered_seconds"], timed["write_direct_seconds"]),
        **timed,
    }


def seconds_of(step) -> float:
    started = time.perf_counter()
    step()
    return time.perf_counter() - started


def read_direct(paths: list[Path]) -> None:
    buffer = mmap.mmap(-1, WRITE_BLOCK)  # page-aligned, as O_DIRECT needs
    try:
        for path in paths:
            descriptor = os.open(path, os.O_RDONLY | os.O_DIRECT)
            try:
                while os.readv(descriptor, [buffer]) == WRITE_BLOCK:
                    pass
            finally:
                os.close(descriptor)
    finally:
        buffer.close()


def write_buffered(path: Path, size: int) -> None:
    block = bytes(WRITE_BLOCK)
    with open(path, "wb") as file:
        for offset in range(0, size, WRITE_BLOCK):
            file.write(block[: min(WRITE_BLOCK, size - offset)])


def write_direct(path: Path, size: int) -> None:
    """`size` bytes (rounded up to a whole page) written with O_DIRECT and made durable."""
    buffer = mmap.mmap(-1, WRITE_BLOCK)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        for offset in range(0, size, WRITE_BLOCK):
            length = -(-min(WRITE_BLOCK, size - offset) // mmap.PAGESIZE) * mmap.PAGESIZE
            os.writev(descriptor, [memoryview(buffer)[:length]])
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
        buffer.close()


def run_job(
    tool: str,
    checkpoint_dir: Path,
    target_dir: Path,
    *,
    cold: bool,
    spec_cache: Path,
    environment: dict[str, str],
    fresh_target: bool = True,
    flags: tuple[str, ...] = (),
) -> dict:
    """One merge in a fresh process; `spec_cache` is mergeflow's model-spec cache directory (empty: a config
    it has not seen, the first merge of a training run). Without `fresh_target`, the target keeps what an
    earlier run wrote there. `flags` go to `mergeflow merge` (the `cli` tool)."""
    if fresh_target:
        shutil.rmtree(target_dir, ignore_errors=True)
    if cold:
        drop_page_cache(shard_files(checkpoint_dir))
    else:
        warm_page_cache(shard_files(checkpoint_dir))
    wait_for_quiet_disk(checkpoint_dir)
    result = subprocess.run([sys.executable, "-m", "bench.job", tool, str(checkpoint_dir), str(target_dir), *flags],
                            capture_output=True, text=True, check=False,
                            env={**environment, CACHE_DIR_VARIABLE: str(spec_cache)})
    if result.returncode != 0:
        raise RuntimeError(f"{tool} failed on {checkpoint_dir}:\n{result.stderr[-3000:]}")
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    os.sync()
    return {**measured, "cache": "cold" if cold else "warm"}


def median_floor(floors: list[dict[str, float]]) -> dict[str, float]:
    """The middle of the floors sampled after each tool's runs (the disk's speed drifts over minutes; one
    sample can catch it at its fastest or slowest)."""
    return sorted(floors, key=floor_seconds)[len(floors) // 2]


@dataclass(frozen=True)
class Step:
    """One timed run of a round: a tool, a page cache, for mergeflow whether it has seen the config, and for
    the CLI whether a Prefect server is running. A "cache hit" runs the CLI again on the target of an untimed
    first run."""

    tool: str
    cold: bool
    config: str = "-"
    server: bool = False
    """The CLI talks to a running server (PREFECT_API_URL) instead of starting a temporary one."""

    @property
    def name(self) -> str:
        return {"cli": "mergeflow merge (CLI)"}.get(self.tool, self.tool) + (", running server" if self.server else "")

    def describe(self) -> str:
        config = f", {self.config}" if self.tool != "verl" else ""
        return f"{self.name} ({'cold' if self.cold else 'warm'} cache{config})"


STEPS = (
    Step("mergeflow", cold=True, config="new config"),
    Step("mergeflow", cold=True, config="seen config"),
    Step("mergeflow", cold=False, config="seen config"),
    Step("mergeflow-no-crc", cold=True, config="seen config"),
    Step("cli", cold=True, config="new config"),
    Step("cli", cold=True, config="seen config"),
    Step("cli", cold=True, config="new config", server=True),
    Step("cli", cold=True, config="seen config", server=True),
    Step("cli", cold=True, config="cache hit", server=True),
    Step("mergeflow-fp8", cold=True, config="seen config"),
    Step("verl", cold=True),
    Step("verl", cold=False),
)


def round_steps(round_number: int, with_verl: bool) -> list[Step]:
    """The round's steps, rotated by one more place each round: a run that follows heavy I/O (the disk's
    speed drifts, and a throttled disk is slower after a burst) is not always the same kind of run."""
    steps = [step for step in STEPS if with_verl or step.tool != "verl"]
    shift = (round_number - 1) % len(steps)
    return steps[shift:] + steps[:shift]


def run_step(
    step: Step, checkpoint_dir: Path, outputs: dict[str, Path], spec_caches: dict[str, Path], server_url: str
) -> dict:
    """A config mergeflow has not seen runs with an emptied spec cache (it imports transformers and builds
    the model on the meta device); a seen one with the cache its spec was stored in before the rounds, as
    for every later checkpoint of a training run. The first cold run of each tool writes the output the
    tools' outputs are compared by."""
    keep_output = step.tool in outputs and step.cold and step.config != "seen config"
    target = outputs[step.tool] if keep_output else warm_target(outputs.get(step.tool, outputs["mergeflow"]))
    spec_cache = spec_caches.get(step.config, spec_caches["seen config"])
    if step.config == "new config":
        shutil.rmtree(spec_cache, ignore_errors=True)
    print(f"{checkpoint_dir.name}: {step.describe()} ...", flush=True)
    environment = {**os.environ, "PREFECT_API_URL": server_url} if step.server else dict(os.environ)
    if step.config == "cache hit":
        run_job(step.tool, checkpoint_dir, target, cold=False, spec_cache=spec_cache, environment=environment)
    run = run_job(
        step.tool,
        checkpoint_dir,
        target,
        cold=step.cold,
        spec_cache=spec_cache,
        environment=environment,
        fresh_target=step.config != "cache hit",
    )
    if not keep_output:
        shutil.rmtree(target, ignore_errors=True)
    return {**run, "step": step.name, "config": step.config}


TIMELINE_STEPS = (
    Step("cli", cold=True, config="seen config", server=True),
    Step("cli", cold=True, config="seen config"),
    Step("cli", cold=True, config="new config", server=True),
)
"""The runs whose timeline the bench prints (untimed: reading the task runs back from the server adds to them)."""


def timeline_of(
    step: Step, checkpoint_dir: Path, outputs: dict[str, Path], spec_caches: dict[str, Path], server_url: str,
    path: Path,
) -> list[dict]:
    """One more run of `step`, with MERGEFLOW_TIMELINE set: the moments its processes wrote."""
    path.unlink(missing_ok=True)
    os.environ[TIMELINE_VARIABLE] = str(path)
    try:
        run_step(step, checkpoint_dir, outputs, spec_caches, server_url)
    finally:
        del os.environ[TIMELINE_VARIABLE]
    return read_moments(path)


def store_spec(checkpoint_dir: Path, spec_cache: Path) -> None:
    """Build the checkpoint's spec into `spec_cache`, untimed, as a first merge of its config would."""
    subprocess.run([sys.executable, "-m", "mergeflow.spec.build", str(checkpoint_dir / "huggingface")],
                   env={**os.environ, CACHE_DIR_VARIABLE: str(spec_cache)}, check=True)


def warm_target(target: Path) -> Path:
    return target.with_name(target.name + "-again")


def output_tensors(model_dir: Path) -> dict[str, Path]:
    return {name: path for path in sorted(model_dir.glob("*.safetensors"))
            for name in safe_open(path, framework="pt").keys()}


def identical_outputs(first: Path, second: Path) -> bool:
    """Same tensor names, and every tensor equal in dtype, shape and bits (read one at a time)."""
    first_files, second_files = output_tensors(first), output_tensors(second)
    if first_files.keys() != second_files.keys():
        return False
    for name in first_files:
        with safe_open(first_files[name], framework="pt") as a, safe_open(second_files[name], framework="pt") as b:
            left, right = a.get_tensor(name), b.get_tensor(name)
            if left.dtype != right.dtype or not torch.equal(left, right):
                return False
    return True


def output_bytes(model_dir: Path) -> int:
    return sum(path.stat().st_size for path in model_dir.glob("*.safetensors"))


def bench_model(model: str, workdir: Path, with_verl: bool, rounds: int, server_url: str) -> dict:
    """`rounds` rounds, each of mergeflow's runs and verl's two (`round_steps`), an I/O floor sample after
    each run; the medians count."""
    checkpoint_dir = workdir / "checkpoints" / model
    if not (checkpoint_dir / "fsdp_config.json").exists() or len(shard_files(checkpoint_dir)) != WORLD_SIZE:
        print(f"writing {model} checkpoint ({WORLD_SIZE} ranks, fp32) ...", flush=True)
        shutil.rmtree(checkpoint_dir, ignore_errors=True)
        write_checkpoint(model, WORLD_SIZE, checkpoint_dir)
    shard_bytes = sum(path.stat().st_size for path in shard_files(checkpoint_dir))
    outputs = {tool: workdir / "outputs" / f"{model}-{tool}" for tool in ("mergeflow", "verl")}
    spec_caches = {"new config": workdir / "spec-cache-new", "seen config": workdir / "spec-cache-seen"}
    shutil.rmtree(spec_caches["seen config"], ignore_errors=True)
    store_spec(checkpoint_dir, spec_caches["seen config"])
    runs, floors = [], []
    for round_number in range(1, rounds + 1):
        print(f"{model}: round {round_number} of {rounds}", flush=True)
        for step in round_steps(round_number, with_verl):
            run = run_step(step, checkpoint_dir, outputs, spec_caches, server_url)
            floor = io_floor(checkpoint_dir, output_bytes(outputs["mergeflow"]), workdir / "outputs" / "floor.bin")
            runs.append({"model": model, "round": round_number, **run, "floor_seconds": floor_seconds(floor)})
            floors.append(floor)
    timelines = {
        step.describe(): timeline_of(step, checkpoint_dir, outputs, spec_caches, server_url, workdir / "timeline.jsonl")
        for step in TIMELINE_STEPS
    }
    result = {
        "model": model,
        "shard_bytes": shard_bytes,
        "output_bytes": output_bytes(outputs["mergeflow"]),
        **median_floor(floors),
        "floor_samples": floors,
        "runs": runs,
        "timelines": timelines,
        "identical_to_verl": identical_outputs(outputs["mergeflow"], outputs["verl"]) if with_verl else None,
    }
    for path in outputs.values():
        shutil.rmtree(path, ignore_errors=True)
    return result


def run_kinds(result: dict) -> dict[tuple[str, str, str], list[dict]]:
    """The runs grouped by step, page cache and config, in the order first run."""
    kinds: dict[tuple[str, str, str], list[dict]] = {}
    for run in result["runs"]:
        kinds.setdefault((run["step"], run["cache"], run.get("config", "-")), []).append(run)
    return kinds


def table(results: list[dict]) -> str:
    """One row per step, page cache and config: median wall time (and each run's), ratios of medians, the
    highest peak RSS of its runs, and for the CLI the median split of its time (until the flow run begins:
    imports and any server start; the flow run)."""
    header = ("model", "tool", "page cache", "config", "wall s", "each run s", "vs verl", "x floor",
              "peak RSS GB", "until flow s", "flow s")
    rows = [header]
    for result in results:
        kinds = run_kinds(result)
        verl = {cache: median([run["wall_seconds"] for run in runs])
                for (step, cache, _), runs in kinds.items() if step == "verl"}
        for (step, cache, config), runs in kinds.items():
            wall = median([run["wall_seconds"] for run in runs])
            ratio = f"{wall / verl[cache]:.2f}x" if cache in verl else "-"
            rows.append((result["model"], step, cache, config, f"{wall:.1f}",
                         " ".join(f"{run['wall_seconds']:.1f}" for run in runs), ratio, f"{floor_ratio(runs):.2f}x",
                         f"{max(run['peak_rss_bytes'] for run in runs) / GB:.2f}",
                         _median_of(runs, "until_flow_seconds"), _median_of(runs, "flow_seconds")))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(header))]
    lines = [" | ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "-+-".join("-" * width for width in widths))
    floors = [f"{r['model']}: read {r['read_seconds']:.1f}s + write {r['write_seconds']:.1f}s "
              f"(median of {samples(r)}), {r['shard_bytes'] / GB:.2f} GB -> {r['output_bytes'] / GB:.2f} GB, "
              f"identical to verl: {r['identical_to_verl']}" for r in results]
    return "\n".join([*lines, "", "I/O floor (same run; median of its samples, read + write, each the faster of page cache and O_DIRECT):", *floors])


def floor_ratio(runs: list[dict]) -> float:
    """The median over the runs of each one's wall time over the I/O floor sampled right after it (the disk's speed
    drifts over minutes: a run is compared with the floor of its own minute)."""
    return median([run["wall_seconds"] / run["floor_seconds"] for run in runs])


def timelines_text(results: list[dict]) -> str:
    return "\n\n".join(f"Timeline of one run, {result['model']}: {name}\n{render(moments)}"
                       for result in results for name, moments in result.get("timelines", {}).items())


def _median_of(runs: list[dict], field: str) -> str:
    values = [run[field] for run in runs if run.get(field) is not None]
    return f"{median(values):.1f}" if values else "-"


def samples(result: dict) -> str:
    return ", ".join(f"{floor['read_seconds']:.1f}+{floor['write_seconds']:.1f}" for floor in result["floor_samples"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--verl-models", nargs="*", default=VERL_MODELS)
    parser.add_argument("--json", type=Path, default=Path("bench/results/bench.json"))
    parser.add_argument("--chart", type=Path, default=Path("docs/img/wall-time.svg"),
                        help="where the chart of wall time against model size goes (default docs/img/wall-time.svg)")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"rounds of runs per model (default {ROUNDS})")
    args = parser.parse_args()
    os.environ["PREFECT_HOME"] = str(args.workdir / "prefect-home")
    os.environ.update(PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1")
    os.environ.pop("PREFECT_API_URL", None)
    with running_prefect_server(args.workdir / "prefect-server.log") as server_url:
        results = [
            bench_model(model, args.workdir, model in args.verl_models, args.rounds, server_url) for model in args.models
        ]
    print(table(results))
    print()
    print(timelines_text(results))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    draw(args.json, args.chart)
    print(f"\nwritten: {args.json}, {args.chart}")


@contextlib.contextmanager
def running_prefect_server(log: Path) -> Iterator[str]:
    """`prefect server start` for the CLI runs against a running server (its database also serves the
    temporary servers the other CLI runs start: the same PREFECT_HOME); yields its API URL."""
    from mergeflow.deployments.server import TemporaryServer, healthy

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    api_url = f"http://127.0.0.1:{port}/api"
    migrating = TemporaryServer()  # the database's migrations, once, outside any timed run
    migrating.wait()
    migrating.stop()
    with open(log, "w") as output:
        server = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env={**os.environ, "PREFECT_UI_API_URL": api_url, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"},
            stdout=output, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + QUIET_TIMEOUT_SECONDS
            while not healthy(api_url) and time.monotonic() < deadline:
                time.sleep(0.5)
            yield api_url
        finally:
            server.terminate()
            server.wait()


if __name__ == "__main__":
    main()
