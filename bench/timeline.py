"""The timeline of one `mergeflow merge` run, from the file its processes wrote (`mergeflow.perf.timeline`).

    python -m bench.timeline TIMELINE_JSONL

Each line: seconds since the command was launched, the process (the command, its write-ahead and spec-build
children; task runs as the Prefect server recorded them), what happened, and for a process's own moments
the CPU seconds it had used (all its threads) and the storage bytes it had read and written so far.
"""

import json
import sys
from pathlib import Path

LAUNCHED = "launched"
"""The bench's own first moment: when it started the command's process."""
GB = 1e9


def read_moments(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def process_names(moments: list[dict]) -> dict[int, str]:
    """Each process id's name, from the moment it said it started."""
    return {moment["pid"]: moment["process"] for moment in moments if "process" in moment}


def render(moments: list[dict]) -> str:
    """The moments in time order, one line each, seconds since the launch."""
    launched = min((moment["at"] for moment in moments if moment["event"] == LAUNCHED), default=None)
    origin = launched if launched is not None else min(moment["at"] for moment in moments)
    names = process_names(moments)
    lines = [f"{'s':>7}  {'process':<18} {'cpu s':>6} {'read GB':>7} {'wrote GB':>8}  event"]
    for moment in sorted(moments, key=lambda moment: moment["at"]):
        process = "prefect task run" if moment.get("task") else names.get(moment["pid"], str(moment["pid"]))
        cpu = f"{moment['cpu_seconds']:6.2f}" if "cpu_seconds" in moment else " " * 6
        read = f"{moment['read_bytes'] / GB:7.2f}" if "read_bytes" in moment else " " * 7
        wrote = f"{moment['write_bytes'] / GB:8.2f}" if "write_bytes" in moment else " " * 8
        lines.append(f"{moment['at'] - origin:7.2f}  {process:<18} {cpu} {read} {wrote}  {moment['event']}")
    return "\n".join(lines)


def main() -> None:
    print(render(read_moments(Path(sys.argv[1]))))


if __name__ == "__main__":
    main()
