"""`prefect.yaml` deploys the merge-on-checkpoint and sweep deployments to a work pool."""

import os
import subprocess
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client

from mergeflow.run_layout import target_path

pytestmark = [pytest.mark.usefixtures("prefect_server"), pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def deployed(prefect_server, tmp_path_factory):
    env = {
        **os.environ,
        "MERGEFLOW_SOURCE_DIR": str(REPO),
        "MERGEFLOW_RUN_DIR": "/checkpoints/run-a",
        "MERGEFLOW_OUTPUT": "/models",
    }
    for command in (
        ["prefect", "work-pool", "create", "mergeflow", "--type", "process", "--overwrite"],
        ["prefect", "--no-prompt", "deploy", "--all", "--prefect-file", str(REPO / "prefect.yaml")],
    ):
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
    with get_client(sync_client=True) as client:
        return {d.name: d for d in client.read_deployments()}


def test_both_deployments_are_on_the_work_pool(deployed):
    assert {deployed[name].work_pool_name for name in ("on-checkpoint", "sweep")} == {"mergeflow"}


def test_event_trigger_keeps_its_templates_for_the_event(deployed):
    with get_client(sync_client=True) as client:
        automations = client.read_automations()
    (automation,) = [a for a in automations if a.actions[0].deployment_id == deployed["on-checkpoint"].id]
    parameters = automation.actions[0].parameters
    assert parameters["local_dir"] == "{{ event.payload.local_dir }}"
    field = "{{{{ event.payload.{} }}}}".format
    assert parameters["target_dir"] == target_path("/models", field("run"), field("step"), field("role"))
    assert parameters["options"]["backend"] == field("backend")


def test_sweep_runs_on_a_schedule_over_the_configured_run(deployed):
    sweep = deployed["sweep"]
    assert [schedule.schedule.cron for schedule in sweep.schedules] == ["0 * * * *"]
    assert sweep.parameters == {"run_dirs": ["/checkpoints/run-a"], "output_dir": "/models"}
