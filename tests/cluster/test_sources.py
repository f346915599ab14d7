"""Adapter sources: s3:// against a real SeaweedFS, hf:// against a local Hub, local dirs under allowed roots."""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from pathlib import Path

import pytest

from cluster.errors import AdapterNotFoundError, BadAdapterSourceError, SourceUnavailableError
from cluster.sources import LocalSource, SourceSettings, parse_adapter_uri
from lora_core.lora_model import LoRAModel
from tests.cluster.conftest import free_ports, upload_dir

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _load(path: Path) -> LoRAModel:
    return LoRAModel.from_local_checkpoint(path, MODULES)


def _adapter_files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


# ---- parsing -----------------------------------------------------------------------------------


@pytest.mark.parametrize("uri,kind,canonical", [
    ("s3://my-bucket/adapters/sql/", "S3Source", "s3://my-bucket/adapters/sql"),
    ("s3://my-bucket", "S3Source", "s3://my-bucket"),
    ("hf://org/repo", "HFSource", "hf://org/repo"),
    ("hf://org/repo@v1.0", "HFSource", "hf://org/repo@v1.0"),
    ("hf://org/repo@refs/pr/3", "HFSource", "hf://org/repo@refs/pr/3"),
])
def test_parse_remote(uri, kind, canonical):
    source = parse_adapter_uri(uri, SourceSettings())
    assert type(source).__name__ == kind and source.uri == canonical
    assert parse_adapter_uri(source.uri, SourceSettings()) == source


@pytest.mark.parametrize("uri", [
    "org/repo", "relative/dir", "", "gs://bucket/x", "http://host/x", "s3://", "s3://Bad_Bucket/x",
    "s3://bucket//x", "s3://bucket/a/../b", "hf://org", "hf://org/repo/extra", "hf://org/repo@",
    "hf://org/../repo", "hf://org/repo@main/../x", "hf://org/repo@a//b", "file://host/x", "file:relative",
    "/tmp/a\nb",
])
def test_parse_refuses(uri):
    with pytest.raises(BadAdapterSourceError):
        parse_adapter_uri(uri, SourceSettings(allowed_local_roots=["/tmp"]))


def test_bare_repo_id_names_accepted_forms():
    with pytest.raises(BadAdapterSourceError, match="hf://org/repo.*s3://bucket/prefix|s3://bucket/prefix.*hf://"):
        parse_adapter_uri("org/repo", SourceSettings())


def test_describe_hides_token():
    settings = SourceSettings(hf_token="hf_secret", hf_endpoint="http://127.0.0.1:1")
    assert "hf_secret" not in parse_adapter_uri("hf://org/repo", settings).describe()


# ---- S3 ----------------------------------------------------------------------------------------


@pytest.fixture
def bucket(s3_client) -> str:
    name = f"adapters-{uuid.uuid4().hex[:12]}"
    s3_client.create_bucket(Bucket=name)
    return name


def test_s3_fetch_takes_only_adapter_files(s3_env, s3_client, bucket, peft_adapter_dir, tmp_path, caplog):
    upload_dir(s3_client, bucket, "team/sql", peft_adapter_dir)
    s3_client.put_object(Bucket=bucket, Key="team/sql/README.md", Body=b"junk")
    s3_client.put_object(Bucket=bucket, Key="team/sql/adapter_model.bin", Body=b"pickle")
    s3_client.put_object(Bucket=bucket, Key="team/sql/checkpoint-1/adapter_model.safetensors", Body=b"nested")
    source = parse_adapter_uri(f"s3://{bucket}/team/sql/", SourceSettings(s3_endpoint_url=s3_env.endpoint_url))
    with caplog.at_level("INFO", logger="cluster"):
        out = source.fetch(tmp_path / "sql")
    assert _adapter_files(out) == _adapter_files(peft_adapter_dir)
    assert "adapter_model.safetensors" in caplog.text and "bytes" in caplog.text
    expected = _load(peft_adapter_dir)
    loaded = _load(out)
    assert loaded.rank == expected.rank and loaded.loras.keys() == expected.loras.keys()


def test_s3_fingerprint_follows_content(s3_env, s3_client, bucket, peft_adapter_dir):
    upload_dir(s3_client, bucket, "a", peft_adapter_dir)
    source = parse_adapter_uri(f"s3://{bucket}/a", SourceSettings(s3_endpoint_url=s3_env.endpoint_url))
    first = source.fingerprint()
    assert source.fingerprint() == first
    s3_client.put_object(Bucket=bucket, Key="a/adapter_config.json", Body=b'{"r": 4}')
    assert source.fingerprint() != first


@pytest.mark.parametrize("where", ["empty-prefix", "config-missing", "no-bucket"])
def test_s3_missing_adapter_is_not_found(s3_env, s3_client, bucket, tmp_path, where):
    s3_client.put_object(Bucket=bucket, Key="weights-only/adapter_model.safetensors", Body=b"x")
    uri = {"empty-prefix": f"s3://{bucket}/nothing-here", "config-missing": f"s3://{bucket}/weights-only",
           "no-bucket": "s3://no-such-bucket-lorafleet/x"}[where]
    source = parse_adapter_uri(uri, SourceSettings(s3_endpoint_url=s3_env.endpoint_url))
    with pytest.raises(AdapterNotFoundError):
        source.fetch(tmp_path / "out")
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []  # no scratch left behind


def test_s3_unreachable_endpoint_fails_fast(s3_env, tmp_path):
    (port,) = free_ports(1)  # closed: nothing listens there
    source = parse_adapter_uri("s3://bucket/x", SourceSettings(s3_endpoint_url=f"http://127.0.0.1:{port}",
                                                               timeout_s=2))
    start = time.monotonic()
    with pytest.raises(SourceUnavailableError):
        source.fetch(tmp_path / "out")
    assert time.monotonic() - start < 15


def test_s3_silent_endpoint_times_out(s3_env, tmp_path):
    with socket.socket() as listener:  # accepts connections, never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        source = parse_adapter_uri("s3://bucket/x", SourceSettings(
            s3_endpoint_url=f"http://127.0.0.1:{listener.getsockname()[1]}", timeout_s=0.5))
        start = time.monotonic()
        with pytest.raises(SourceUnavailableError):
            source.fetch(tmp_path / "out")
        assert time.monotonic() - start < 15


def test_s3_wrong_credentials_are_unavailable_not_missing(s3_env, s3_client, bucket, peft_adapter_dir, tmp_path,
                                                          monkeypatch):
    upload_dir(s3_client, bucket, "a", peft_adapter_dir)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    source = parse_adapter_uri(f"s3://{bucket}/a", SourceSettings(s3_endpoint_url=s3_env.endpoint_url))
    with pytest.raises(SourceUnavailableError, match="403"):
        source.fetch(tmp_path / "out")


# ---- the Hub -----------------------------------------------------------------------------------


def _hf(hf_server, **kw) -> SourceSettings:
    return SourceSettings(hf_endpoint=hf_server.endpoint, timeout_s=5, **kw)


def test_hf_fetch_pins_revision(hf_server, peft_adapter_dir, demo_checkpoint, tmp_path):
    v1 = _adapter_files(peft_adapter_dir)
    v2 = _adapter_files(demo_checkpoint.adapters["demo-chat"])
    repo = f"org/adapter-{uuid.uuid4().hex[:8]}"
    shas = hf_server.add_repo(repo, {
        "main": {**v2, "README.md": b"# card", "training_args.bin": b"pickle", "sub/adapter_model.safetensors": b"x"},
        "v1": v1})
    hf_server.requests.clear()
    out_main = parse_adapter_uri(f"hf://{repo}", _hf(hf_server)).fetch(tmp_path / "main")
    out_v1 = parse_adapter_uri(f"hf://{repo}@v1", _hf(hf_server)).fetch(tmp_path / "v1")
    out_sha = parse_adapter_uri(f"hf://{repo}@{shas['v1']}", _hf(hf_server)).fetch(tmp_path / "sha")
    assert _adapter_files(out_main) == v2 and _adapter_files(out_v1) == v1 == _adapter_files(out_sha)
    assert _load(out_main).rank == 16 and _load(out_v1).rank == 8
    downloaded = {p.split("/resolve/")[1].split("/", 1)[1] for m, p in hf_server.requests
                  if m == "GET" and "/resolve/" in p}
    assert downloaded == {"adapter_config.json", "adapter_model.safetensors"}  # allow-patterns held
    assert parse_adapter_uri(f"hf://{repo}@v1", _hf(hf_server)).fingerprint() == f"hf:{shas['v1']}"


def test_hf_private_repo_needs_token(hf_server, peft_adapter_dir, tmp_path):
    repo = f"org/private-{uuid.uuid4().hex[:8]}"
    hf_server.add_repo(repo, {"main": _adapter_files(peft_adapter_dir)}, token="hf_good")
    with pytest.raises(AdapterNotFoundError):
        parse_adapter_uri(f"hf://{repo}", _hf(hf_server, hf_token="hf_bad")).fetch(tmp_path / "a")
    out = parse_adapter_uri(f"hf://{repo}", _hf(hf_server, hf_token="hf_good")).fetch(tmp_path / "b")
    assert _adapter_files(out) == _adapter_files(peft_adapter_dir)


@pytest.mark.parametrize("case", ["no-repo", "no-revision", "no-config"])
def test_hf_missing_is_not_found(hf_server, tmp_path, case):
    repo = f"org/r-{uuid.uuid4().hex[:8]}"
    hf_server.add_repo(repo, {"main": {"adapter_model.safetensors": b"x", "README.md": b"hi"}})
    uri = {"no-repo": "hf://org/does-not-exist", "no-revision": f"hf://{repo}@nope", "no-config": f"hf://{repo}"}
    with pytest.raises(AdapterNotFoundError):
        parse_adapter_uri(uri[case], _hf(hf_server)).fetch(tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_hf_server_error_is_unavailable(hf_server, monkeypatch, tmp_path):
    monkeypatch.setattr(hf_server, "fail_with", 503)
    start = time.monotonic()
    with pytest.raises(SourceUnavailableError):
        parse_adapter_uri("hf://org/any", _hf(hf_server)).fetch(tmp_path / "out")
    assert time.monotonic() - start < 15


def test_hf_unreachable_is_unavailable(tmp_path):
    (port,) = free_ports(1)
    settings = SourceSettings(hf_endpoint=f"http://127.0.0.1:{port}", timeout_s=2)
    start = time.monotonic()
    with pytest.raises(SourceUnavailableError):
        parse_adapter_uri("hf://org/any", settings).fetch(tmp_path / "out")
    assert time.monotonic() - start < 15


# ---- local directories -------------------------------------------------------------------------


@pytest.fixture
def roots(tmp_path, peft_adapter_dir):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    for d in (allowed / "sql", outside / "sql"):
        d.mkdir(parents=True)
        for name, data in _adapter_files(peft_adapter_dir).items():
            (d / name).write_bytes(data)
    (allowed / "sql" / "notes.txt").write_text("not copied")
    return allowed, outside


def test_local_inside_root(roots, tmp_path, peft_adapter_dir):
    allowed, _ = roots
    settings = SourceSettings(allowed_local_roots=[allowed])
    for uri in (str(allowed / "sql"), f"file://{allowed / 'sql'}", f"file://localhost{allowed / 'sql'}/"):
        source = parse_adapter_uri(uri, settings)
        assert isinstance(source, LocalSource)
        out = source.fetch(tmp_path / "out" / uuid.uuid4().hex)
        assert _adapter_files(out) == _adapter_files(peft_adapter_dir)
    assert source.fingerprint() == parse_adapter_uri(str(allowed / "sql"), settings).fingerprint()


def test_local_outside_root_refused(roots):
    allowed, outside = roots
    with pytest.raises(BadAdapterSourceError, match="outside"):
        parse_adapter_uri(str(outside / "sql"), SourceSettings(allowed_local_roots=[allowed]))
    with pytest.raises(BadAdapterSourceError, match="no allowed_local_roots"):
        parse_adapter_uri(str(allowed / "sql"), SourceSettings())


def test_local_dotdot_refused_without_touching_the_filesystem(roots, monkeypatch):
    allowed, _ = roots
    settings = SourceSettings(allowed_local_roots=[allowed])

    def touched(*args, **kwargs):
        raise AssertionError("the filesystem was touched")

    for name in ("stat", "lstat", "listdir", "scandir", "readlink"):
        monkeypatch.setattr(os, name, touched)
    monkeypatch.setattr(os.path, "realpath", touched)
    monkeypatch.setattr(Path, "resolve", touched)
    for uri in (f"{allowed}/../outside/sql", f"{allowed}/sql/..", f"file://{allowed}/%2e%2e/outside/sql"):
        with pytest.raises(BadAdapterSourceError, match=r"'\.\.'"):
            parse_adapter_uri(uri, settings)


def test_local_symlink_escaping_root_refused(roots, tmp_path):
    allowed, outside = roots
    settings = SourceSettings(allowed_local_roots=[allowed])
    (allowed / "escape").symlink_to(outside / "sql", target_is_directory=True)
    with pytest.raises(BadAdapterSourceError, match="resolves .through a symlink. to a place outside"):
        parse_adapter_uri(str(allowed / "escape"), settings)
    # a file symlinked out of the root is refused too, not copied
    (allowed / "mixed").mkdir()
    (allowed / "mixed" / "adapter_config.json").write_text(json.dumps({}))
    (allowed / "mixed" / "adapter_model.safetensors").symlink_to(outside / "sql" / "adapter_model.safetensors")
    with pytest.raises(BadAdapterSourceError, match="symlink"):
        parse_adapter_uri(str(allowed / "mixed"), settings).fetch(tmp_path / "out")
    # a symlink inside the root is fine
    (allowed / "alias").symlink_to(allowed / "sql", target_is_directory=True)
    assert parse_adapter_uri(str(allowed / "alias"), settings).fetch(tmp_path / "ok").is_dir()


def test_local_missing_dir_is_not_found(roots, tmp_path):
    allowed, _ = roots
    settings = SourceSettings(allowed_local_roots=[allowed])
    with pytest.raises(AdapterNotFoundError):
        parse_adapter_uri(str(allowed / "nope"), settings).fetch(tmp_path / "out")
    (allowed / "empty").mkdir()
    with pytest.raises(AdapterNotFoundError):
        parse_adapter_uri(str(allowed / "empty"), settings).fetch(tmp_path / "out")


def test_fetch_refuses_non_empty_destination(roots, tmp_path):
    allowed, _ = roots
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(FileExistsError):
        parse_adapter_uri(str(allowed / "sql"), SourceSettings(allowed_local_roots=[allowed])).fetch(tmp_path / "busy")
