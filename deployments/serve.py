"""`mergeflow serve`: the merge deployment triggered by checkpoint events, the scheduled sweep, and the
watchers that emit those events, served from one process against the configured Prefect server."""

import asyncio
import dataclasses
import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
from prefect.deployments.runner import RunnerDeployment
from prefect.events import DeploymentEventTrigger
from prefect.runner import Runner

from mergeflow.deployments.server import API_URL_VARIABLE
from mergeflow.deployments.watcher import EVENT_NAME, RESOURCE_PREFIX, announce, watching
from mergeflow.flows.merge import merge_checkpoint
from mergeflow.flows.sweep import is_merged, sweep_checkpoints
from mergeflow.flows.task_runners import task_runner_from
from mergeflow.log_handlers import every_log_handler
from mergeflow.options import DEFAULT_OPTIONS, HubUpload, MergeOptions
from mergeflow.run_layout import Checkpoint, complete_checkpoints, label_of, target_path

MERGE_DEPLOYMENT = "on-checkpoint"
SWEEP_DEPLOYMENT = "sweep"
DEFAULT_SWEEP_INTERVAL_SECONDS = 3600
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
STOP_SECONDS = 2.5
"""How long a stop waits for the runner to cancel its merges and pause its deployments (a server that does not
answer would keep it retrying for minutes)."""
POLL_SECONDS = 3.0
ANSWERS_TO_BE_BACK = 2

logger = logging.getLogger("mergeflow.serve")


@dataclass(frozen=True)
class ServeOptions:
    run_dirs: list[str]
    output_dir: str
    options: MergeOptions = DEFAULT_OPTIONS
    """The merges' options (each checkpoint's backend and role set its `backend` and `is_value_model`)."""
    hub: HubUpload | None = None
    schedule: str | None = None
    """A cron expression for the sweep; without one it runs every hour."""
    concurrency: int = 1
    """Merges at once; more runs wait their turn."""
    task_runner: str = "threads"


def checkpoint_trigger(options: ServeOptions) -> DeploymentEventTrigger:
    """Fire the merge deployment on `mergeflow.checkpoint.saved`; its parameters come from the event."""
    field = "{{{{ event.payload.{} }}}}".format
    merge_options = {**dataclasses.asdict(options.options), "backend": field("backend"), "is_value_model": field("is_value_model")}
    return DeploymentEventTrigger(
        name="merge each new checkpoint",
        expect={EVENT_NAME},
        match={"prefect.resource.id": f"{RESOURCE_PREFIX}*"},
        parameters={
            "local_dir": field("local_dir"),
            "target_dir": target_path(options.output_dir, field("run"), field("step"), field("role")),
            "options": merge_options,
        },
    )


def build_deployments(options: ServeOptions) -> list[RunnerDeployment]:
    merge_parameters = {
        "options": dataclasses.asdict(options.options),
        "hub": dataclasses.asdict(options.hub) if options.hub else None,
    }
    limit = ConcurrencyLimitConfig(limit=options.concurrency, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE)
    merge_flow = merge_checkpoint.with_options(task_runner=task_runner_from(options.task_runner))
    on_checkpoint = merge_flow.to_deployment(
        name=MERGE_DEPLOYMENT,
        triggers=[checkpoint_trigger(options)],
        parameters={**merge_parameters, "progress": False},
        concurrency_limit=limit,
        description="Merge a verl checkpoint when the watcher announces it.",
    )
    schedule = {"cron": options.schedule} if options.schedule else {"interval": DEFAULT_SWEEP_INTERVAL_SECONDS}
    sweep = sweep_checkpoints.to_deployment(
        name=SWEEP_DEPLOYMENT,
        parameters={
            "run_dirs": options.run_dirs,
            "output_dir": options.output_dir,
            "task_runner": options.task_runner,
            **merge_parameters,
        },
        concurrency_limit=1,
        description="Merge every complete checkpoint not merged yet.",
        **schedule,
    )
    return [on_checkpoint, sweep]


def serve_forever(options: ServeOptions, say: Callable[[str], None] = print) -> None:
    """Register the deployments (and with them the checkpoint trigger), then start a watcher per run
    directory, so that checkpoints complete before serve started are announced to a trigger that exists;
    serve until SIGTERM, SIGINT or SIGHUP. What it watches, each checkpoint announced, each merge finished and
    each outage of the Prefect server are said on the console, one line each."""
    runner = Runner(limit=options.concurrency)
    for deployment in build_deployments(options):
        runner.add_deployment(deployment)
    for line in watch_summary(options.run_dirs, options.output_dir):
        say(line)
    outages = ServerOutages(say)
    outages.attach()

    def announce_and_say(checkpoint: Checkpoint, version: str) -> None:
        announce(checkpoint, version)
        say(f"{checkpoint.label} saved: merging it into {checkpoint.target_in(options.output_dir)}")

    with watching(options.run_dirs, emit=announce_and_say), MergeReports(options.output_dir, say, outages):
        serve_until_signalled(runner, say)


def watch_summary(run_dirs: list[str], output_dir: str) -> list[str]:
    """One line per run: its complete checkpoints, how many are merged already, and how many wait."""
    lines = []
    for run_dir in run_dirs:
        complete = complete_checkpoints(Path(run_dir))
        waiting = [checkpoint for checkpoint in complete if not is_merged(checkpoint, output_dir)]
        found = (
            f"{len(complete)} complete checkpoint(s), {len(complete) - len(waiting)} merged already, "
            f"{len(waiting)} to merge"
            if complete
            else "no complete checkpoint yet"
        )
        lines.append(f"watching {run_dir}: {found}")
    return lines


def serve_until_signalled(runner: Runner, say: Callable[[str], None]) -> None:
    """Run `runner` until SIGTERM, SIGINT or SIGHUP, then stop it (its in-flight merges are cancelled and resume
    on a later run) and return within STOP_SECONDS, whether or not the Prefect server answers."""
    stop = threading.Event()
    loops: list[asyncio.AbstractEventLoop] = []

    async def run() -> None:
        loops.append(asyncio.get_running_loop())
        await runner.start()

    serving = threading.Thread(target=asyncio.run, args=(run(),), name="mergeflow-serve", daemon=True)
    previous = {signum: signal.signal(signum, lambda *_: stop.set()) for signum in STOP_SIGNALS}
    try:
        serving.start()
        while not stop.wait(timeout=1.0) and serving.is_alive():
            pass
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    say("stopping")
    if serving.is_alive() and loops:
        asyncio.run_coroutine_threadsafe(runner.astop(), loops[0])
        serving.join(timeout=STOP_SECONDS)
    say("stopped")


class ServerOutages(logging.Filter):
    """Prefect's tracebacks for a Prefect server that does not answer, said as one warning line per outage (and
    one line when it answers again) instead of a traceback per retry."""

    def __init__(self, say: Callable[[str], None]):
        super().__init__()
        self._say = say
        self._away = False
        self._answers_since_away = 0
        self._lock = threading.Lock()

    def attach(self) -> None:
        """Filter the records of every handler Prefect's logging has set up."""
        for handler in every_log_handler():
            handler.addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is None or not is_connection_error(error):
            return True
        self.away(error)
        return False

    def away(self, error: BaseException) -> None:
        with self._lock:
            self._answers_since_away = 0
            if self._away:
                return
            self._away = True
        self._say(f"warning: the Prefect server at {os.environ.get(API_URL_VARIABLE)} does not answer "
                  f"({type(error).__name__}); serving goes on and reconnects when it is back")  # fmt: skip

    def answered(self) -> None:
        """Note one poll the server answered; it is back after ANSWERS_TO_BE_BACK in a row (a server that is
        shutting down may answer one more request on a connection it still holds)."""
        with self._lock:
            self._answers_since_away += 1
            if not self._away or self._answers_since_away < ANSWERS_TO_BE_BACK:
                return
            self._away = False
        self._say("the Prefect server answers again")


def is_connection_error(error: BaseException) -> bool:
    """Whether an error (or one it was raised from) says the server could not be reached or went away."""
    import httpx
    import websockets.exceptions

    while error is not None:
        if isinstance(error, httpx.TransportError | websockets.exceptions.WebSocketException | ConnectionError):
            return True
        error = error.__cause__ or error.__context__
    return False


class MergeReports:
    """A thread that says each merge into `output_dir` that finishes while serving (read from the Prefect API every
    POLL_SECONDS), and tells `outages` whether the server answers."""

    def __init__(self, output_dir: str, say: Callable[[str], None], outages: ServerOutages):
        self._output_dir = Path(output_dir)
        self._say = say
        self._outages = outages
        self._since = datetime.now(UTC)
        self._reported: set = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="mergeflow-merge-reports", daemon=True)

    def __enter__(self) -> "MergeReports":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()

    def _poll(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            try:
                finished = self._finished_merges()
            except Exception as error:  # retried at the next poll
                if is_connection_error(error):
                    self._outages.away(error)
                else:
                    logger.warning("reading the finished merges failed: %s", error)
                continue
            self._outages.answered()
            for flow_run in finished:
                self._reported.add(flow_run.id)
                self._say(merge_line(flow_run))

    def _finished_merges(self) -> list:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import (
            FlowFilter,
            FlowFilterName,
            FlowRunFilter,
            FlowRunFilterEndTime,
            FlowRunFilterState,
            FlowRunFilterStateType,
        )
        from prefect.client.schemas.objects import TERMINAL_STATES

        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(
                flow_filter=FlowFilter(name=FlowFilterName(any_=[merge_checkpoint.name])),
                flow_run_filter=FlowRunFilter(
                    state=FlowRunFilterState(type=FlowRunFilterStateType(any_=list(TERMINAL_STATES))),
                    end_time=FlowRunFilterEndTime(after_=self._since),
                ),
            )
        return [
            run
            for run in runs
            if run.id not in self._reported
            and Path(str(run.parameters.get("target_dir", ""))).is_relative_to(self._output_dir)
        ]


def merge_line(flow_run) -> str:
    """`merged run-a/step-1/actor into OUT/run-a/global_step_1/actor`, or why it did not."""
    checkpoint = label_of(flow_run.parameters["local_dir"])
    if flow_run.state.is_completed():
        return f"merged {checkpoint} into {flow_run.parameters['target_dir']}"
    return f"merge of {checkpoint} {flow_run.state.name.lower()}: {flow_run.state.message or 'see the Prefect UI'}"
