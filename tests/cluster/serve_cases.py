"""Helpers for tests against a real Ray Serve app on loopback: free ports, bounded waits, the replica actors
Serve runs, and plain or streamed completions over httpx."""

from __future__ import annotations

import re
import shutil
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, NamedTuple

import httpx
import pytest
import ray
from ray import serve

from cluster.adapter_tier_actor import DEFAULT_NAME as TIER_NAME

HTTP_TIMEOUT_S = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(condition: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.2) -> Any:
    """condition()'s first truthy value; fails the test after timeout_s (exceptions count as not yet)."""
    deadline, last_exc = time.monotonic() + timeout_s, None
    while True:
        try:
            value = condition()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - not ready yet
            last_exc = exc
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what} (last error: {last_exc!r})")
        time.sleep(interval_s)


def _replica_actors(app: str) -> dict[str, Any]:
    """The LoRAReplica actors of `app` Serve lists (name -> actor handle), through Ray's named actors."""
    prefix = f"SERVE_REPLICA::{app}#LoRAReplica#"
    actors = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].startswith(prefix):
            try:
                actors[a["name"].removeprefix(prefix)] = ray.get_actor(a["name"], namespace=a["namespace"])
            except ValueError:  # died meanwhile
                pass
    return actors


def _complete(base: str, model: str, max_tokens: int = 8, **extra: Any) -> dict:
    r = httpx.post(f"{base}/v1/completions", timeout=HTTP_TIMEOUT_S,
                   json={"model": model, "prompt": "The quick brown fox", "max_tokens": max_tokens,
                         "temperature": 0, **extra})
    assert r.status_code == 200, (model, r.status_code, r.text)
    body = r.json()
    assert body["usage"]["completion_tokens"] >= 1
    return body


def _concurrently(calls: list[Callable[[], Any]]) -> list[Any]:
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        return [f.result(timeout=HTTP_TIMEOUT_S * 2) for f in [pool.submit(c) for c in calls]]


def _running_replicas(app: str) -> int:
    status = serve.status().applications.get(app)
    if status is None:
        return 0
    return status.deployments["LoRAReplica"].replica_states.get("RUNNING", 0)


def _stream(base: str, body: dict) -> tuple[int, list[str]]:
    """(status, the SSE data events) of a streamed completion."""
    with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True},
                      timeout=httpx.Timeout(HTTP_TIMEOUT_S, read=30.0)) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, [r.text]
        return 200, [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]


def _retries(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=HTTP_TIMEOUT_S).text
    return float(re.search(r"^lorafleet_requests_retried_after_replica_loss_total (\S+)$", text, re.M).group(1))


class Cluster(NamedTuple):
    base: str  # http://127.0.0.1:port
    adapter_root: Path  # an allowed local root holding fresh copies of the demo adapters
    demo_adapter: Path  # a demo adapter directory to copy from


def _tier_actor():
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"] == TIER_NAME:
            return ray.get_actor(TIER_NAME, namespace=a["namespace"])
    raise LookupError("no adapter-tier actor")


def _tier_metrics(base: str) -> dict[str, float]:
    """The tier's counters as the app exports them on /metrics."""
    text = httpx.get(f"{base}/metrics", timeout=HTTP_TIMEOUT_S).text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r"^lorafleet_adapter_tier_(\w+) ([0-9.eE+-]+)$", text, re.MULTILINE)}


def _register(cluster: Cluster, name: str, base: str | None = None) -> None:
    """Load a fresh copy of a demo adapter from a local directory under the allowed root."""
    path = cluster.adapter_root / name
    if not path.exists():
        shutil.copytree(cluster.demo_adapter, path)
    r = httpx.post(f"{base or cluster.base}/v1/load_lora_adapter", timeout=HTTP_TIMEOUT_S,
                   json={"lora_name": name, "lora_path": str(path)})
    assert r.status_code == 200, r.text
