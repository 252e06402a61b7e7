"""A local stand-in for the Hugging Face Hub: the endpoints huggingface_hub calls to create a repo, a
branch, and a commit (preupload, LFS batch and upload, ndjson commit), with fault injection.

It stores what it receives, so tests compare the stored files with the local ones, and records
every request (method, path, time, whether it carried the right token).
"""

import base64
import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LFS_MIN_BYTES = 1024
"""Files this large (or any .safetensors) are announced as LFS uploads, as the Hub does for binaries."""
INITIAL_FILE = ".gitattributes"


@dataclass
class Fault:
    """Answer the next `times` requests matching `method` and `path` (a regex) with `status`."""

    method: str
    path: str
    status: int
    times: int = 1
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Request:
    method: str
    path: str
    at: float
    status: int
    authorized: bool


@dataclass
class Repo:
    private: bool
    branches: dict[str, dict[str, bytes]]
    """Branch -> path -> content."""
    commits: dict[str, list[str]] = field(default_factory=dict)
    """Branch -> commit messages, oldest first."""


def git_blob_oid(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


class FakeHub:
    """The server's state; `url` is what HF_ENDPOINT points at."""

    def __init__(self, token: str):
        self.token = token
        self.repos: dict[str, Repo] = {}
        self.lfs_objects: dict[str, bytes] = {}
        self.lfs_uploads: list[str] = []
        self.faults: list[Fault] = []
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address
        return f"http://{host}:{port}"

    def start(self) -> "FakeHub":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def inject(self, fault: Fault) -> None:
        with self._lock:
            self.faults.append(fault)

    def files(self, repo_id: str, branch: str) -> dict[str, bytes]:
        return self.repos[repo_id].branches[branch]

    def requests_to(self, method: str, path_pattern: str) -> list[Request]:
        return [r for r in self.requests if r.method == method and re.search(path_pattern, r.path)]

    def take_fault(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if fault.times > 0 and fault.method == method and re.search(fault.path, path):
                    fault.times -= 1
                    return fault
        return None

    def record(self, request: Request) -> None:
        with self._lock:
            self.requests.append(request)


def _handler_for(hub: FakeHub):
    routes = [
        ("POST", r"^/api/repos/create$", "create_repo"),
        ("POST", r"^/api/validate-yaml$", "validate_yaml"),
        ("POST", r"^/api/models/(?P<repo>[^/]+/[^/]+)/branch/(?P<branch>[^?]+)$", "create_branch"),
        ("GET", r"^/api/models/(?P<repo>[^/]+/[^/]+)/revision/(?P<branch>[^?]+)", "repo_info"),
        ("GET", r"^/api/models/(?P<repo>[^/]+/[^/]+)/refs", "list_refs"),
        ("POST", r"^/api/models/(?P<repo>[^/]+/[^/]+)/preupload/(?P<branch>[^?]+)", "preupload"),
        ("POST", r"^/(?P<repo>[^/]+/[^/]+)\.git/info/lfs/objects/batch$", "lfs_batch"),
        ("PUT", r"^/lfs-upload/(?P<oid>[0-9a-f]+)$", "lfs_upload"),
        ("POST", r"^/api/models/(?P<repo>[^/]+/[^/]+)/commit/(?P<branch>[^?]+)", "commit"),
    ]

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            self._dispatch("GET")

        def do_POST(self) -> None:
            self._dispatch("POST")

        def do_PUT(self) -> None:
            self._dispatch("PUT")

        def _dispatch(self, method: str) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            path = self.path
            authorized = self.headers.get("Authorization") == f"Bearer {hub.token}"
            fault = hub.take_fault(method, path)
            if fault is not None:
                return self._reply(method, path, authorized, fault.status, {"error": "injected fault"}, fault.headers)
            if not authorized and not path.startswith("/lfs-upload/"):
                return self._reply(method, path, authorized, 401, {"error": "Invalid credentials in Authorization header"})
            for route_method, pattern, name in routes:
                match = re.match(pattern, path)
                if route_method == method and match:
                    status, payload = getattr(self, name)(body, **match.groupdict())
                    return self._reply(method, path, authorized, status, payload)
            return self._reply(method, path, authorized, 404, {"error": f"no route for {method} {path}"})

        def _reply(self, method, path, authorized, status: int, payload, headers: dict | None = None) -> None:
            hub.record(Request(method, path, time.monotonic(), status, authorized))
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            if status >= 400:
                self.send_header("X-Error-Message", payload.get("error", ""))
            self.end_headers()
            self.wfile.write(data)

        def create_repo(self, body: bytes):
            request = json.loads(body)
            repo_id = f"{request['organization'] or 'user'}/{request['name']}"
            if repo_id in hub.repos:
                return 409, {"error": "You already created this model repo", "url": f"{hub.url}/{repo_id}"}
            hub.repos[repo_id] = Repo(
                private=request.get("visibility") == "private" or bool(request.get("private")),
                branches={"main": {INITIAL_FILE: b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"}},
                commits={"main": ["initial commit"]},
            )
            return 200, {"url": f"{hub.url}/{repo_id}", "name": repo_id}

        def validate_yaml(self, body: bytes):
            return 200, {"errors": [], "warnings": []}

        def create_branch(self, body: bytes, repo: str, branch: str):
            branches = hub.repos[repo].branches
            if branch in branches:
                return 409, {"error": f"Reference already exists: refs/heads/{branch}"}
            branches[branch] = dict(branches["main"])
            hub.repos[repo].commits[branch] = list(hub.repos[repo].commits["main"])
            return 200, {}

        def repo_info(self, body: bytes, repo: str, branch: str):
            files = hub.repos[repo].branches[branch]
            return 200, {
                "id": repo,
                "sha": hashlib.sha1(repr(sorted(files.items())).encode()).hexdigest(),
                "private": hub.repos[repo].private,
                "siblings": [{"rfilename": name} for name in sorted(files)],
            }

        def list_refs(self, body: bytes, repo: str):
            return 200, {"branches": [{"name": name, "ref": f"refs/heads/{name}", "targetCommit": "0" * 40}
                                      for name in hub.repos[repo].branches], "converts": [], "tags": []}

        def preupload(self, body: bytes, repo: str, branch: str):
            stored = hub.repos[repo].branches.get(branch, {})
            answers = []
            for file in json.loads(body)["files"]:
                path = file["path"]
                lfs = file["size"] >= LFS_MIN_BYTES or path.endswith(".safetensors")
                oid = None
                if path in stored:
                    oid = hashlib.sha256(stored[path]).hexdigest() if lfs else git_blob_oid(stored[path])
                answers.append({"path": path, "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": oid})
            return 200, {"files": answers}

        def lfs_batch(self, body: bytes, repo: str):
            objects = []
            for obj in json.loads(body)["objects"]:
                answer = {"oid": obj["oid"], "size": obj["size"]}
                if obj["oid"] not in hub.lfs_objects:
                    answer["actions"] = {"upload": {"href": f"{hub.url}/lfs-upload/{obj['oid']}"}}
                objects.append(answer)
            return 200, {"transfer": "basic", "objects": objects}

        def lfs_upload(self, body: bytes, oid: str):
            if hashlib.sha256(body).hexdigest() != oid:
                return 400, {"error": "sha256 mismatch"}
            hub.lfs_objects[oid] = body
            hub.lfs_uploads.append(oid)
            return 200, {}

        def commit(self, body: bytes, repo: str, branch: str):
            lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
            header = next(line["value"] for line in lines if line["key"] == "header")
            files = dict(hub.repos[repo].branches.get(branch, {}))
            for line in lines:
                value = line["value"]
                if line["key"] == "file":
                    files[value["path"]] = base64.b64decode(value["content"])
                elif line["key"] == "lfsFile":
                    if value["oid"] not in hub.lfs_objects:
                        return 422, {"error": f"LFS object {value['oid']} was never uploaded"}
                    files[value["path"]] = hub.lfs_objects[value["oid"]]
                elif line["key"] in ("deletedFile", "deletedFolder"):
                    files.pop(value["path"], None)
            hub.repos[repo].branches[branch] = files
            hub.repos[repo].commits.setdefault(branch, []).append(header["summary"])
            oid = hashlib.sha1(repr(sorted(files.items())).encode()).hexdigest()
            return 200, {"success": True, "commitOid": oid, "commitUrl": f"{hub.url}/{repo}/commit/{oid}"}

    return Handler
