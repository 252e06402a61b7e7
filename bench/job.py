"""Run one merge and print its measurements as JSON (the bench runs each in a fresh child).

    python -m bench.job mergeflow|mergeflow-no-crc|mergeflow-fp8|cli|verl CHECKPOINT_DIR TARGET_DIR [CLI FLAGS...]

`mergeflow` is the engine alone (`MergeJob`, no Prefect); `mergeflow-no-crc` the same with the CRC-32 checks
turned off (to measure what they cost; the product has no such switch); `mergeflow-fp8` the engine merging to
FP8 (`--quantize fp8`); `cli` is `mergeflow merge` end to
end in a child process, with Prefect, against PREFECT_API_URL when the environment sets it (a running
server) or with the temporary server the command starts itself.

Peak RSS is this process's `VmHWM` (not `ru_maxrss`, which Linux carries over from the parent through
fork and exec, so a child of a large bench process would report the parent's size); bytes read and written are the storage-layer counters of
/proc/self/io (page-cache hits read nothing), with `rchar`/`wchar` for bytes passed through syscalls.
"""

import datetime
import json
import os
import resource
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

from bench.timeline import LAUNCHED
from mergeflow.perf import timeline

VERL_PACKAGE = "verl"


def merge_with_mergeflow(checkpoint_dir: Path, target_dir: Path, quantize: str | None = None) -> None:
    """The engine's merge, as `mergeflow merge` starts it: the read-ahead and a new config's spec build begin
    before the imports that need torch (`mergeflow.write_ahead.warm_up`), then the steps run without Prefect."""
    from mergeflow.job import MergeJob
    from mergeflow.options import MergeOptions
    from mergeflow.write_ahead import warm_up

    job = MergeJob(checkpoint_dir, target_dir, MergeOptions(quantize=quantize))
    warm_up(job)
    job.run()


def merge_without_crc(checkpoint_dir: Path, target_dir: Path) -> None:
    """The engine's merge with the checkpoint's CRC-32s left unchecked: the cost of the checks, by difference."""
    from mergeflow.formats.record_check import RecordCheck

    RecordCheck.add = lambda self, file_offset, data: None
    RecordCheck.finish = lambda self, read: None
    merge_with_mergeflow(checkpoint_dir, target_dir)


def merge_to_fp8(checkpoint_dir: Path, target_dir: Path) -> None:
    merge_with_mergeflow(checkpoint_dir, target_dir, quantize="fp8")


def merge_with_cli(checkpoint_dir: Path, target_dir: Path, *flags: str) -> dict:
    """`mergeflow merge` as users run it, with `flags` besides the paths; the split of its time from its log:
    until the flow run begins (imports, and the temporary server's start where there is one), the flow run,
    and the end."""
    started = time.time()
    timeline.mark(LAUNCHED, process="bench")
    done = subprocess.run(
        [sys.executable, "-m", "mergeflow", "merge", "--no-progress", "--local_dir", str(checkpoint_dir),
         "--target_dir", str(target_dir), *flags],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"mergeflow merge failed:\n{done.stderr[-3000:]}")
    log_times = [_log_time(line, started) for line in done.stdout.splitlines() + done.stderr.splitlines()]
    flow_lines = [moment for moment, line in zip(log_times, done.stdout.splitlines() + done.stderr.splitlines(), strict=True)
                  if moment is not None and "Flow run '" in line]  # fmt: skip
    return {
        "until_flow_seconds": flow_lines[0] if flow_lines else None,
        "flow_seconds": flow_lines[-1] - flow_lines[0] if flow_lines else None,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
        "server": "running" if os.environ.get("PREFECT_API_URL") else "temporary",
        "started_at": started,
        "ended_at": time.time(),
    }


def _log_time(line: str, started: float) -> float | None:
    """Seconds since `started` of a Prefect log line (`07:21:32.428 | INFO | ...`), if the line is one."""
    stamp = line.split(" | ", 1)[0]
    try:
        clock = datetime.datetime.strptime(stamp, "%H:%M:%S.%f").time()
    except ValueError:
        return None
    day = datetime.datetime.fromtimestamp(started).date()
    return datetime.datetime.combine(day, clock).timestamp() - started


def import_verl_merger():
    """verl's merger without running verl/__init__ (which imports ray and the trainer)."""
    import importlib.util

    spec = importlib.util.find_spec(VERL_PACKAGE)
    package = types.ModuleType(VERL_PACKAGE)
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules[VERL_PACKAGE] = package
    from verl.model_merger.base_model_merger import ModelMergerConfig
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger

    return ModelMergerConfig, FSDPModelMerger


def merge_with_verl(checkpoint_dir: Path, target_dir: Path) -> None:
    config_class, merger_class = import_verl_merger()
    config = config_class(operation="merge", backend="fsdp", local_dir=str(checkpoint_dir),
                          hf_model_config_path=str(checkpoint_dir / "huggingface"), target_dir=str(target_dir))
    target_dir.mkdir(parents=True, exist_ok=True)
    merger_class(config).merge_and_save()


TOOLS = {
    "mergeflow": merge_with_mergeflow,
    "mergeflow-no-crc": merge_without_crc,
    "mergeflow-fp8": merge_to_fp8,
    "cli": merge_with_cli,
    "verl": merge_with_verl,
}


def io_counters() -> dict[str, int]:
    counters = {}
    for line in Path("/proc/self/io").read_text().splitlines():
        key, value = line.split(":")
        counters[key] = int(value)
    return counters


RSS_FIELDS = ("RssAnon", "RssFile", "RssShmem")


def high_water_rss() -> int:
    """The kernel's peak resident set of this process image, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == "VmHWM":
            return int(value.split()[0]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM")
RSS_SAMPLE_SECONDS = 0.05


class RssSampler:
    """Peaks of the resident-set components (anonymous, file-backed, shared), sampled on a thread."""

    def __init__(self):
        self.peaks = dict.fromkeys(RSS_FIELDS, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for line in Path("/proc/self/status").read_text().splitlines():
                key, _, value = line.partition(":")
                if key in self.peaks:
                    self.peaks[key] = max(self.peaks[key], int(value.split()[0]) * 1024)
            time.sleep(RSS_SAMPLE_SECONDS)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    tool, checkpoint_dir, target_dir, flags = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:]
    before = io_counters()
    started = time.perf_counter()
    with RssSampler() as rss:
        measured = TOOLS[tool](checkpoint_dir, target_dir, *flags) or {}
    wall = time.perf_counter() - started
    after = io_counters()
    print(json.dumps({
        "tool": tool,
        "wall_seconds": wall,
        "peak_rss_bytes": high_water_rss(),
        **{f"peak_{key}_bytes": value for key, value in rss.peaks.items()},
        **{key: after[key] - before[key] for key in ("read_bytes", "write_bytes", "rchar", "wchar")},
        **measured,
    }))


if __name__ == "__main__":
    main()
