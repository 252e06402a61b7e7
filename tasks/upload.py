import time
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_link_artifact
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from mergeflow.errors import UploadError
from mergeflow.hub import UploadResult, upload_model
from mergeflow.options import UPLOAD_RETRIES, UPLOAD_RETRY_DELAY_SECONDS, HubUpload
from mergeflow.output.manifest import SavedModel
from mergeflow.tasks.publish import artifact_key

RETRY_JITTER_FACTOR = 0.5
MAX_RETRY_AFTER_SECONDS = 600.0


def retry_transient_only(task, task_run, state) -> bool:
    """Prefect's retry condition: retry Hub outages, rate limits and network errors, nothing else."""
    error = state.result(raise_on_failure=False)
    return isinstance(error, UploadError) and error.transient


@task(
    name="upload",
    cache_policy=NO_CACHE,
    retries=UPLOAD_RETRIES,
    retry_delay_seconds=exponential_backoff(backoff_factor=UPLOAD_RETRY_DELAY_SECONDS),
    retry_jitter_factor=RETRY_JITTER_FACTOR,
    retry_condition_fn=retry_transient_only,
)
def upload(saved: SavedModel, hub: HubUpload, *, revision: str, checkpoint_dir: str, commit_message: str) -> UploadResult:
    """Upload the merged folder to the Hub on `revision`; a rate limit's Retry-After is waited out before the next
    attempt."""
    folder, repo_id = saved.folder, hub.repo_id
    token = _token_from_secret(hub.token_secret)
    try:
        result = upload_model(
            Path(folder), repo_id, revision=revision, private=hub.private, token=token, commit_message=commit_message
        )
    except UploadError as e:
        if e.retry_after:
            get_run_logger().warning("the Hub asked to wait %.0f s before retrying", e.retry_after)
            time.sleep(min(e.retry_after, MAX_RETRY_AFTER_SECONDS))
        raise
    get_run_logger().info("uploaded %s to %s@%s: %s", folder, repo_id, revision, result.commit_url)
    create_link_artifact(
        key=artifact_key("hub-upload", checkpoint_dir, folder),
        link=result.commit_url,
        link_text=f"{repo_id}@{revision}",
        description=f"mergeflow upload of {checkpoint_dir}",
    )
    return result


def _token_from_secret(block_name: str | None) -> str | None:
    """The token held by a Prefect Secret block; None leaves it to huggingface_hub (HF_TOKEN, then the login)."""
    if block_name is None:
        return None
    from prefect.blocks.system import Secret

    return Secret.load(block_name).get()
