"""MERGEFLOW_TIMELINE: where a merge's time goes, written by every process of a `mergeflow merge`."""

import json
import os
import subprocess
import sys

import pytest

from bench.timeline import render
from mergeflow.perf import timeline
from tests.cli_runs import run_cli


def moments_of(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_marks_are_not_written_without_a_timeline_file(tmp_path, monkeypatch):
    monkeypatch.delenv(timeline.TIMELINE_VARIABLE, raising=False)
    monkeypatch.chdir(tmp_path)

    timeline.mark("nothing")

    assert list(tmp_path.iterdir()) == []


def test_marks_of_several_processes_land_one_per_line(tmp_path):
    path = tmp_path / "timeline.jsonl"
    mark = "from mergeflow.perf import timeline\nfor n in range(200): timeline.mark(f'moment {n}', padding='x' * 500)"
    writers = [
        subprocess.Popen([sys.executable, "-c", mark], env={**os.environ, timeline.TIMELINE_VARIABLE: str(path)})
        for _ in range(3)
    ]
    assert [writer.wait() for writer in writers] == [0, 0, 0]

    moments = moments_of(path)

    assert len(moments) == 600
    assert len({moment["pid"] for moment in moments}) == 3


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_server")
def test_a_merge_puts_its_processes_writes_and_task_runs_on_the_timeline(fixtures, tmp_path):
    path = tmp_path / "timeline.jsonl"
    checkpoint = fixtures["qwen2-ws2"].checkpoint_dir

    run = run_cli("merge", "--local_dir", checkpoint, "--target_dir", tmp_path / "out",
                  env={**os.environ, timeline.TIMELINE_VARIABLE: str(path)})  # fmt: skip

    assert run.returncode == 0, run.stderr
    moments = moments_of(path)
    processes = {moment["process"] for moment in moments if "process" in moment}
    events = {moment["event"] for moment in moments}
    assert {"mergeflow command", "write-ahead child"} <= processes
    assert {"flow imported", "server ready", "flow returned", "write model.safetensors ended"} <= events
    assert {"task write model.safetensors started", "task write model.safetensors ended"} <= events
    assert any(event.startswith("task publish-") for event in events)
    assert "write-ahead child" in render(moments)
