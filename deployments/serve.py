"""`mergeflow serve`: the merge deployment triggered by checkpoint events, the scheduled sweep, and the
watchers that emit those events, served from one process against the configured Prefect server."""

import asyncio
import logging
from dataclasses import dataclass

from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
from prefect.deployments.runner import RunnerDeployment
from prefect.events import DeploymentEventTrigger
from prefect.runner import Runner

from mergeflow.deployments.watcher import EVENT_NAME, RESOURCE_PREFIX, watching
from mergeflow.flows.merge import merge_checkpoint
from mergeflow.flows.sweep import sweep_checkpoints
from mergeflow.flows.task_runners import task_runner_from
from mergeflow.options import DEFAULT_DTYPE

MERGE_DEPLOYMENT = "on-checkpoint"
SWEEP_DEPLOYMENT = "sweep"
DEFAULT_SWEEP_INTERVAL_SECONDS = 3600

logger = logging.getLogger("mergeflow.serve")


@dataclass(frozen=True)
class ServeOptions:
    run_dirs: list[str]
    output_dir: str
    dtype: str = DEFAULT_DTYPE
    quantize: str | None = None
    drop_mtp: bool = False
    hf_upload_path: str | None = None
    private: bool = False
    hf_token_secret: str | None = None
    schedule: str | None = None
    """A cron expression for the sweep; without one it runs every hour."""
    concurrency: int = 1
    """Merges at once; more runs wait their turn."""
    task_runner: str = "threads"


def checkpoint_trigger(options: ServeOptions) -> DeploymentEventTrigger:
    """Fire the merge deployment on `mergeflow.checkpoint.saved`; its parameters come from the event."""
    payload = "event.payload"
    target = f"{options.output_dir}/{{{{ {payload}.run }}}}/global_step_{{{{ {payload}.step }}}}/{{{{ {payload}.role }}}}"
    return DeploymentEventTrigger(
        name="merge each new checkpoint",
        expect={EVENT_NAME},
        match={"prefect.resource.id": f"{RESOURCE_PREFIX}*"},
        parameters={
            "local_dir": f"{{{{ {payload}.local_dir }}}}",
            "target_dir": target,
            "backend": f"{{{{ {payload}.backend }}}}",
            "is_value_model": f"{{{{ {payload}.is_value_model }}}}",
        },
    )


def build_deployments(options: ServeOptions) -> list[RunnerDeployment]:
    upload = {"hf_upload_path": options.hf_upload_path, "private": options.private, "hf_token_secret": options.hf_token_secret}
    limit = ConcurrencyLimitConfig(limit=options.concurrency, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE)
    merge_flow = merge_checkpoint.with_options(task_runner=task_runner_from(options.task_runner))
    on_checkpoint = merge_flow.to_deployment(
        name=MERGE_DEPLOYMENT,
        triggers=[checkpoint_trigger(options)],
        parameters={
            "dtype": options.dtype, "quantize": options.quantize, "drop_mtp": options.drop_mtp, "progress": False, **upload
        },
        concurrency_limit=limit,
        description="Merge a verl checkpoint when the watcher announces it.",
    )
    schedule = {"cron": options.schedule} if options.schedule else {"interval": DEFAULT_SWEEP_INTERVAL_SECONDS}
    sweep = sweep_checkpoints.to_deployment(
        name=SWEEP_DEPLOYMENT,
        parameters={
            "run_dirs": options.run_dirs, "output_dir": options.output_dir, "dtype": options.dtype,
            "quantize": options.quantize, "drop_mtp": options.drop_mtp, **upload,
        },
        concurrency_limit=1,
        description="Merge every complete checkpoint not merged yet.",
        **schedule,
    )
    return [on_checkpoint, sweep]


def serve_forever(options: ServeOptions) -> None:
    """Register the deployments (and with them the checkpoint trigger), then start a watcher per run
    directory, so that checkpoints complete before serve started are announced to a trigger that exists;
    serve until interrupted."""
    runner = Runner(limit=options.concurrency)
    for deployment in build_deployments(options):
        runner.add_deployment(deployment)
    with watching(options.run_dirs):
        try:
            asyncio.run(runner.start())
        except KeyboardInterrupt:
            logger.info("interrupted: stopped serving")
