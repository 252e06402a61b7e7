"""Publishing a merged model folder to the Hugging Face Hub, or to a mirror at `HF_ENDPOINT`.

huggingface_hub does the work (repo and branch creation, preupload, LFS, commit) and already retries
each request a few times; this module picks the revision, words failures, and tells transient ones
(worth retrying later) from permanent ones (authentication, permissions, a wrong repo id). The token
is passed through and never appears in a message. huggingface_hub is imported by an upload only (a merge
without one does not pay for it).
"""

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mergeflow.errors import UploadError
from mergeflow.formats.verl_run import STEP_DIR
from mergeflow.options import check_repo_id

if TYPE_CHECKING:
    from huggingface_hub.errors import HfHubHTTPError

MAIN_BRANCH = "main"
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
PERMANENT_REASONS = {
    401: "authentication problem: the Hub refused the token",
    403: "permission problem: the token may not write to this repo",
    404: "not found: no such repo or revision, or the token cannot see it",
}
TOKEN_HINT = "set HF_TOKEN, log in with `hf auth login`, or name a Prefect Secret block with --hf-token-secret"
REDACTED = "***"


@dataclass(frozen=True)
class UploadResult:
    repo_id: str
    revision: str
    commit_url: str
    commit_oid: str | None


def training_step(checkpoint_dir: str | Path) -> int | None:
    """N of the `global_step_N` directory a checkpoint lives in (`global_step_N/actor`), if any."""
    for part in reversed(Path(checkpoint_dir).absolute().parts):
        match = STEP_DIR.match(part)
        if match:
            return int(match[1])
    return None


def default_revision(checkpoint_dir: str | Path) -> str:
    """A branch per training step (`step-120`), or main when the checkpoint's step is unknown."""
    step = training_step(checkpoint_dir)
    return f"step-{step}" if step is not None else MAIN_BRANCH


def upload_model(
    model_dir: Path,
    repo_id: str,
    *,
    revision: str = MAIN_BRANCH,
    private: bool = False,
    token: str | None = None,
    commit_message: str,
) -> UploadResult:
    """Create the repo (and branch) if missing and upload the folder in one commit.

    Files the Hub already holds unchanged are skipped by huggingface_hub (same oid), and LFS objects
    it already stores are not sent again, so a re-run after a failure sends only what is missing.

    Raises:
        OptionError: a malformed repo id.
        UploadError: the Hub refused or failed; `transient` says whether a later retry may succeed.
    """
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    check_repo_id(repo_id)
    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None, token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision != MAIN_BRANCH:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        commit = api.upload_folder(
            repo_id=repo_id, folder_path=str(model_dir), revision=revision, commit_message=commit_message
        )
    except HfHubHTTPError as e:
        raise _http_failure(e, api.endpoint, repo_id, revision, token) from None
    except network_errors() as e:
        message = _redacted(f"{type(e).__name__}: {e}", token)
        raise UploadError(
            f"transient problem: cannot reach {api.endpoint} to upload to {repo_id}@{revision} ({message})",
            transient=True,
        ) from None
    return UploadResult(repo_id, revision, str(commit.commit_url), getattr(commit, "oid", None))


def network_errors() -> tuple[type[BaseException], ...]:
    """What a request that never reached the Hub raises: the HTTP client's transport errors, and the OS's."""
    try:
        import httpx2 as httpx
    except ImportError:  # huggingface_hub before 2.x
        import httpx
    return (httpx.TransportError, ConnectionError, TimeoutError)


def _http_failure(
    error: "HfHubHTTPError", endpoint: str, repo_id: str, revision: str, token: str | None
) -> UploadError:
    response = error.response
    status = response.status_code if response is not None else None
    detail = _redacted(str(error).splitlines()[0], token)
    where = f"{endpoint} for {repo_id}@{revision}"
    if status in TRANSIENT_STATUS:
        return UploadError(
            f"transient problem: HTTP {status} from {where} ({detail})",
            transient=True,
            retry_after=_retry_after(response) if status == 429 else None,
        )
    reason = PERMANENT_REASONS.get(status, "the Hub rejected the upload")
    hint = f"; {TOKEN_HINT}" if status in (401, 403) else ""
    return UploadError(f"{reason} (HTTP {status} from {where}: {detail}){hint}", transient=False)


def _retry_after(response) -> float | None:
    value = response.headers.get("Retry-After")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _redacted(text: str, token: str | None) -> str:
    return text.replace(token, REDACTED) if token else text
