"""Run the ranks of a fixture writer: `python -m mergeflow.demo.ranks WORKER JOBS.json`, torch.distributed's
environment (WORLD_SIZE, MASTER_ADDR, MASTER_PORT) set.

The worker module (its imports: torch, transformers, peft, megatron-core, about 7 s of CPU) is imported once,
here, and each rank is a process forked from this one after that, which calls the worker's `main()` as
`python -m WORKER JOBS.json` would, with its RANK set. Exits 1 when a rank fails, after printing the end of
each failed rank's output.
"""

import importlib
import os
import sys
import traceback
from pathlib import Path

OUTPUT_TAIL_CHARS = 4000


def run_rank(worker, rank: int, jobs_file: str, log: Path) -> int:
    """In a forked child: this rank's run of the worker, its output going to `log`. Returns its exit code."""
    descriptor = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    os.environ["RANK"] = str(rank)
    sys.argv = [worker.__name__, jobs_file]
    try:
        worker.main()
        return 0
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def main() -> None:
    worker_name, jobs_file = sys.argv[1], sys.argv[2]
    world_size = int(os.environ["WORLD_SIZE"])
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    worker = importlib.import_module(worker_name)
    logs = [Path(f"{jobs_file}.rank{rank}.log") for rank in range(world_size)]
    children = []
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:
            os._exit(run_rank(worker, rank, jobs_file, logs[rank]))
        children.append(pid)
    failed = [rank for rank, pid in enumerate(children) if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0]
    for rank in failed:
        print(f"rank {rank} failed:\n{logs[rank].read_text()[-OUTPUT_TAIL_CHARS:]}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
