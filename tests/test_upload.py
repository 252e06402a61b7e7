"""Uploading merged models to a Hub (a local server speaking the Hub's endpoints), with retries on
transient failures only, a branch per training step, a model card, and the token kept secret."""

import logging
import time
from pathlib import Path

import huggingface_hub.constants
import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId

from mergeflow.errors import OptionError, UploadError
from mergeflow.flows.merge import merge_checkpoint
from mergeflow.options import HubUpload
from mergeflow.validation.validate import validate_model_dir
from tests.hub_server import FakeHub, Fault
from tests.prefect_runs import API_WAIT_SECONDS

pytestmark = pytest.mark.usefixtures("prefect_server")

TOKEN = "hf_mergeflowTestToken0123456789"
REPO = "alice/qwen2-rl"
FAST_RETRY_SECONDS = 0.2


@pytest.fixture
def hub(monkeypatch):
    """A fresh local Hub; huggingface_hub points at it through HF_ENDPOINT and authenticates with HF_TOKEN."""
    server = FakeHub(token=TOKEN).start()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)  # the local Hub speaks LFS
    yield server
    server.stop()


def merge_and_upload(fixture, target_dir: Path, *, overwrite: bool = False, **upload):
    return merge_checkpoint(
        local_dir=str(fixture.checkpoint_dir),
        target_dir=str(target_dir),
        hub=HubUpload(**{"repo_id": REPO, "retry_delay_seconds": FAST_RETRY_SECONDS, **upload}),
        overwrite=overwrite,
        progress=False,
        return_state=True,
    )


def local_files(model_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(model_dir)): p.read_bytes() for p in sorted(model_dir.rglob("*")) if p.is_file()}


def upload_task_run(state):
    """The flow run's upload task run, once it is final in the API."""
    deadline = time.monotonic() + API_WAIT_SECONDS
    while True:
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
            )
        uploads = [run for run in runs if run.name.startswith("upload")]
        if (uploads and uploads[0].state and uploads[0].state.is_final()) or time.monotonic() > deadline:
            return uploads[0]
        time.sleep(0.5)


def flow_run_logs(state) -> str:
    deadline = time.monotonic() + 5
    with get_client(sync_client=True) as client:
        while True:
            logs = client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id]))
            )
            if logs or time.monotonic() > deadline:
                return "\n".join(log.message for log in logs)
            time.sleep(0.5)


def test_uploaded_files_equal_the_merged_folder(fixtures, hub, target_dir):
    state = merge_and_upload(fixtures["qwen2-ws2"], target_dir)

    assert state.is_completed()
    assert hub.files(REPO, "step-1") == {".gitattributes": hub.files(REPO, "main")[".gitattributes"], **local_files(target_dir)}
    assert hub.lfs_uploads, "the weights go through LFS"


def test_default_revision_is_a_branch_per_training_step_and_main_is_untouched(fixtures, hub, target_dir):
    merge_and_upload(fixtures["qwen2-ws2"], target_dir)

    assert set(hub.repos[REPO].branches) == {"main", "step-1"}
    assert list(hub.files(REPO, "main")) == [".gitattributes"]
    assert hub.repos[REPO].commits["step-1"][-1] == "Upload run/global_step_1/actor merged by mergeflow (training step 1)"


def test_revision_main_uploads_to_main_of_a_private_repo(fixtures, hub, target_dir):
    merge_and_upload(fixtures["qwen2-ws2"], target_dir, revision="main", private=True)

    assert "model.safetensors" in hub.files(REPO, "main")
    assert hub.repos[REPO].private


def test_commit_failures_are_retried_by_the_task_and_counted_in_the_api(fixtures, hub, target_dir):
    hub.inject(Fault("POST", r"/commit/", 503, times=3))

    state = merge_and_upload(fixtures["qwen2-ws2"], target_dir)

    assert state.is_completed()
    assert upload_task_run(state).run_count == 4  # 3 retries mean 4 attempts
    assert hub.files(REPO, "step-1")["model.safetensors"] == (target_dir / "model.safetensors").read_bytes()


@pytest.mark.slow
def test_an_outage_longer_than_huggingface_hubs_own_retries_is_survived(fixtures, hub, target_dir):
    hub.inject(Fault("POST", r"/preupload/", 503, times=10))  # huggingface_hub itself tries 6 times in ~23 s

    state = merge_and_upload(fixtures["qwen2-ws2"], target_dir)

    assert state.is_completed()
    assert upload_task_run(state).run_count == 2
    assert len(hub.requests_to("POST", r"/preupload/")) == 11
    assert hub.files(REPO, "step-1")["model.safetensors"] == (target_dir / "model.safetensors").read_bytes()


def test_retry_after_of_a_rate_limit_is_waited_out(fixtures, hub, target_dir):
    hub.inject(Fault("POST", r"/preupload/", 429, headers={"Retry-After": "2"}))

    state = merge_and_upload(fixtures["qwen2-ws2"], target_dir)

    limited, retried = hub.requests_to("POST", r"/preupload/")[:2]
    assert state.is_completed()
    assert limited.status == 429 and retried.at - limited.at >= 2


def test_authentication_failure_fails_at_once_and_keeps_the_merged_model(fixtures, hub, target_dir, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")

    state = merge_and_upload(fixtures["qwen2-ws2"], target_dir)

    with pytest.raises(UploadError, match=r"authentication problem.*HTTP 401.*set HF_TOKEN"):
        state.result()
    assert upload_task_run(state).run_count == 1
    assert len(hub.requests_to("POST", r"/api/repos/create")) == 1
    assert validate_model_dir(target_dir).passed


def test_the_token_never_appears_in_logs_or_errors(fixtures, hub, target_dir, tmp_path, caplog, capsys):
    caplog.set_level(logging.DEBUG)
    hub.inject(Fault("POST", r"/commit/", 503))
    succeeded = merge_and_upload(fixtures["qwen2-ws2"], target_dir)
    hub.token = "hf_other"  # now the Hub refuses TOKEN
    failed = merge_and_upload(fixtures["qwen2-ws2"], tmp_path / "again")

    failure = failed.result(raise_on_failure=False)
    captured = capsys.readouterr()
    seen = [caplog.text, captured.out, captured.err, str(failure), flow_run_logs(succeeded), flow_run_logs(failed)]
    assert succeeded.is_completed() and failed.is_failed()
    assert not [text for text in seen if TOKEN in text]


def test_a_rerun_after_a_failed_commit_sends_no_lfs_object_twice(fixtures, hub, target_dir, tmp_path):
    hub.inject(Fault("POST", r"/commit/", 400))  # permanent: the first run fails after the LFS uploads
    first = merge_and_upload(fixtures["qwen2-ws2"], target_dir)
    uploaded = list(hub.lfs_uploads)

    second = merge_and_upload(fixtures["qwen2-ws2"], target_dir, overwrite=True)

    assert first.is_failed() and second.is_completed()
    assert uploaded and hub.lfs_uploads == uploaded
    assert hub.files(REPO, "step-1")["model.safetensors"] == (target_dir / "model.safetensors").read_bytes()


def test_an_invalid_repo_id_fails_before_merging(fixtures, hub, target_dir):
    state = merge_and_upload(fixtures["qwen2-ws2"], target_dir, repo_id="not a repo id")

    with pytest.raises(OptionError, match="invalid --hf_upload_path 'not a repo id'"):
        state.result()
    assert not target_dir.exists()
    assert not hub.requests


def test_the_token_can_come_from_a_prefect_secret_block(fixtures, hub, target_dir, monkeypatch):
    from prefect.blocks.system import Secret

    Secret(value=TOKEN).save("mergeflow-test-hub-token", overwrite=True)
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")

    state = merge_and_upload(fixtures["qwen2-ws2"], target_dir, token_secret="mergeflow-test-hub-token")

    assert state.is_completed()
    assert all(request.authorized for request in hub.requests if not request.path.startswith("/lfs-upload/"))
