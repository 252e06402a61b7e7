"""Run one merge in this process and print its measurements as JSON (the bench runs each in a fresh child).

    python -m bench.job mergeflow|verl CHECKPOINT_DIR TARGET_DIR

Peak RSS is this process's `VmHWM` (not `ru_maxrss`, which Linux carries over from the parent through
fork and exec, so a child of a large bench process would report the parent's size); bytes read and written are the storage-layer counters of
/proc/self/io (page-cache hits read nothing), with `rchar`/`wchar` for bytes passed through syscalls.
"""

import json
import sys
import threading
import time
import types
from pathlib import Path

VERL_PACKAGE = "verl"


def merge_with_mergeflow(checkpoint_dir: Path, target_dir: Path) -> None:
    """The merge flow's engine steps, as `mergeflow merge` starts them: the read-ahead and the spec's build (a
    child process) begin before the imports that need torch; the read-ahead ends when the merge starts
    reading for itself, and the shards are written while the spec is built (`mergeflow.early_write`)."""
    from mergeflow.formats.fsdp.layout import default_config_dir, find_rank_files
    from mergeflow.perf.read_ahead import start_read_ahead, stop_read_ahead
    from mergeflow.spec.build import SpecBuild

    rank_files = find_rank_files(checkpoint_dir)
    start_read_ahead(rank_files.data_files)
    build = SpecBuild(default_config_dir(checkpoint_dir))

    from mergeflow.early_write import save_model_early
    from mergeflow.formats.fsdp.index import index_shards

    stop_read_ahead(rank_files.data_files)  # from here on the merge reads for itself
    index = index_shards(rank_files)
    save_model_early(index, build, target_dir, dtype="bf16", progress=False)


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


TOOLS = {"mergeflow": merge_with_mergeflow, "verl": merge_with_verl}


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
    tool, checkpoint_dir, target_dir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    before = io_counters()
    started = time.perf_counter()
    with RssSampler() as rss:
        TOOLS[tool](checkpoint_dir, target_dir)
    wall = time.perf_counter() - started
    after = io_counters()
    print(json.dumps({
        "tool": tool,
        "wall_seconds": wall,
        "peak_rss_bytes": high_water_rss(),
        **{f"peak_{key}_bytes": value for key, value in rss.peaks.items()},
        **{key: after[key] - before[key] for key in ("read_bytes", "write_bytes", "rchar", "wchar")},
    }))


if __name__ == "__main__":
    main()
