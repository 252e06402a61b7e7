"""The watcher announces a checkpoint once verl's tracker file names it, and only once."""

import shutil
import time

import pytest

from mergeflow.deployments.watcher import CheckpointWatcher, event_id
from mergeflow.formats.verl_run import TRACKER_FILE
from tests.run_dirs import save_step

WAIT_SECONDS = 10


class Recorder:
    """Collects what the watcher would emit, as (checkpoint, version)."""

    def __init__(self):
        self.announced = []

    def __call__(self, checkpoint, version):
        self.announced.append((checkpoint, version))

    def labels(self):
        return [checkpoint.label for checkpoint, _ in self.announced]


@pytest.fixture
def run_dir(tmp_path):
    (tmp_path / "run-a").mkdir()
    return tmp_path / "run-a"


@pytest.fixture
def watch(run_dir, tmp_path):
    """Start watchers on `run_dir` sharing one state file; stop them all at the end."""
    started = []

    def start(recorder):
        watcher = CheckpointWatcher(run_dir, state_file=tmp_path / "state.json", emit=recorder)
        watcher.start()
        started.append(watcher)
        return watcher

    yield start
    for watcher in started:
        watcher.stop()


def wait_for(condition) -> bool:
    deadline = time.monotonic() + WAIT_SECONDS
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.1)
    return condition()


def test_checkpoint_is_announced_when_the_tracker_names_it(fixtures, run_dir, watch):
    recorder = Recorder()
    watch(recorder)

    save_step(fixtures["qwen2-ws2"], run_dir, 3)

    assert wait_for(lambda: recorder.labels() == ["run-a/step-3/actor"])


def test_shards_without_a_tracker_update_announce_nothing(fixtures, run_dir, watch):
    recorder = Recorder()
    watch(recorder)

    save_step(fixtures["qwen2-ws2"], run_dir, 3, update_tracker=False)

    time.sleep(2)
    assert recorder.announced == []


def test_steps_above_the_tracker_are_not_announced(fixtures, run_dir, watch):
    save_step(fixtures["qwen2-ws2"], run_dir, 1)
    save_step(fixtures["qwen2-ws2"], run_dir, 2, update_tracker=False)
    recorder = Recorder()

    watch(recorder)

    assert recorder.labels() == ["run-a/step-1/actor"]


def test_restarted_watcher_does_not_announce_again(fixtures, run_dir, watch):
    first = Recorder()
    watch(first).stop()
    save_step(fixtures["qwen2-ws2"], run_dir, 1)
    watch(first)
    assert wait_for(lambda: first.labels() == ["run-a/step-1/actor"])

    second = Recorder()
    watch(second)

    time.sleep(1)
    assert second.announced == []


def test_checkpoint_saved_while_the_watcher_was_down_is_announced_at_start(fixtures, run_dir, watch):
    save_step(fixtures["qwen2-ws2"], run_dir, 1)
    recorder = Recorder()

    watch(recorder)

    assert recorder.labels() == ["run-a/step-1/actor"]


def test_each_role_of_a_step_is_announced(fixtures, run_dir, watch):
    save_step(fixtures["value-ws2"], run_dir, 1, update_tracker=False)
    save_step(fixtures["qwen2-ws2"], run_dir, 1)
    recorder = Recorder()

    watch(recorder)

    assert recorder.labels() == ["run-a/step-1/actor", "run-a/step-1/critic"]


def test_two_watchers_give_the_same_checkpoint_the_same_event_id(fixtures, run_dir, tmp_path):
    save_step(fixtures["qwen2-ws2"], run_dir, 1)
    recorders = [Recorder(), Recorder()]

    for number, recorder in enumerate(recorders):
        CheckpointWatcher(run_dir, state_file=tmp_path / f"state-{number}.json", emit=recorder).scan()

    first, second = (event_id(*recorder.announced[0]) for recorder in recorders)
    assert first == second


def test_megatron_checkpoints_are_announced_with_their_backend(megatron_fixtures, run_dir, tmp_path):
    fixture = megatron_fixtures["megatron-qwen2-tp1"]
    shutil.copytree(fixture.checkpoint_dir, run_dir / "global_step_5" / "actor")
    (run_dir / TRACKER_FILE).write_text("5")
    recorder = Recorder()

    CheckpointWatcher(run_dir, state_file=tmp_path / "state.json", emit=recorder).scan()

    assert [(c.label, c.backend) for c, _ in recorder.announced] == [("run-a/step-5/actor", "megatron")]
