"""Retake the screenshot of a merge's run graph in the Prefect UI (docs/img/run-graph.png), from a real run.

    python scripts/run_graph_screenshot.py [--chromium /usr/bin/chromium] [--output docs/img/run-graph.png]

Starts `mergeflow server` on a free port with a Prefect home of its own, runs `mergeflow demo` against it,
and has headless Chromium (`apt-get install chromium`) load that merge's flow-run page and save it.
"""

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mergeflow.demo.fsdp import _free_port
from mergeflow.deployments.server import healthy

START_SECONDS = 120
WINDOW = "1600,1000"
RENDER_MILLISECONDS = 20_000
"""Virtual time the page gets to fetch the run and lay out its graph before the screenshot."""
MERGE_FLOW = "merge-checkpoint"


def latest_merge_run_id(api_url: str) -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=[MERGE_FLOW])), sort=FlowRunSort.START_TIME_DESC, limit=1
        )
    return str(runs[0].id)


def screenshot(chromium: str, url: str, output: Path, profile: Path) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--hide-scrollbars", f"--user-data-dir={profile}",
         f"--window-size={WINDOW}", f"--virtual-time-budget={RENDER_MILLISECONDS}", f"--screenshot={output.absolute()}",
         url],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    parser.add_argument("--output", type=Path, default=Path("docs/img/run-graph.png"))
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="mergeflow-screenshot-"))
    port = _free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    os.environ.update(PREFECT_HOME=str(workdir / "prefect-home"), PREFECT_API_URL=api_url, DO_NOT_TRACK="1")
    server = subprocess.Popen([sys.executable, "-m", "mergeflow", "server", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + START_SECONDS
        while not healthy(api_url):
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError(f"mergeflow server did not answer on {api_url}")
            time.sleep(0.5)
        subprocess.run([sys.executable, "-m", "mergeflow", "demo", "--workdir", str(workdir / "demo")], check=True)
        run_id = latest_merge_run_id(api_url)
        screenshot(args.chromium, f"http://127.0.0.1:{port}/runs/flow-run/{run_id}", args.output, workdir / "chromium")
        print(f"written: {args.output}")
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
