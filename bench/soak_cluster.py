"""The soak's cluster (bench/soak.py): a local Ray with the demo Serve app, its adapter sources, and what the soak
reads and does to it from outside (replica actors, their RSS, kills, routing stats, the registry file).

The app's args are deploy/config.yaml's, with a fixed replica count, small CPU shares, a temporary registry_dir
and a temporary allowed root holding copies of the demo adapters and two adapters a load must refuse.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import ray
import safetensors.torch
import yaml
from ray import serve
from ray._private import state as ray_state

from cluster.adapter_registry import REGISTRY_FILE
from cluster.app import build_app

APP = "soak"
REPO = Path(__file__).resolve().parents[1]
RAY_CALL_TIMEOUT_S = 10.0
READY_TIMEOUT_S = 180.0
BROKEN_RANK = 64  # above the demo config's max_lora_rank (32)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_sources(root: Path, demo_adapters: dict[str, Path]) -> tuple[dict[str, str], dict[str, str]]:
    """Copies of the demo adapters under root (source name -> directory), and two broken ones a load must refuse:
    "rank" (a well-formed adapter of rank BROKEN_RANK) and "nan" (demo-sql with a NaN in one tensor)."""
    good = {}
    for name, path in demo_adapters.items():
        good[name] = str(shutil.copytree(path, root / name))
    broken = {"rank": root / "broken-rank", "nan": root / "broken-nan"}
    sql = demo_adapters["demo-sql"]
    for dest in broken.values():
        shutil.copytree(sql, dest)
    config = json.loads((sql / "adapter_config.json").read_text())
    tensors = safetensors.torch.load_file(str(sql / "adapter_model.safetensors"))
    reps = BROKEN_RANK // config["r"]
    wide = {k: t.repeat(reps, 1) if "lora_A" in k else t.repeat(1, reps) / reps for k, t in tensors.items()}
    safetensors.torch.save_file(wide, str(broken["rank"] / "adapter_model.safetensors"), metadata={"format": "pt"})
    (broken["rank"] / "adapter_config.json").write_text(json.dumps({**config, "r": BROKEN_RANK,
                                                                    "lora_alpha": 2 * BROKEN_RANK}))
    key = sorted(tensors)[0]
    tensors[key] = tensors[key].clone()
    tensors[key][0, 0] = float("nan")
    safetensors.torch.save_file(tensors, str(broken["nan"] / "adapter_model.safetensors"), metadata={"format": "pt"})
    return good, {k: str(v) for k, v in broken.items()}


def app_args(root: Path, registry_dir: Path, replicas: int, replica_cpus: float) -> dict[str, Any]:
    """deploy/config.yaml's app args with a fixed replica count and the soak's directories."""
    config = yaml.safe_load((REPO / "deploy" / "config.yaml").read_text())
    args = next(a for a in config["applications"] if a["import_path"] == "cluster.app:build_app")["args"]
    args["tier"] = {**args["tier"], "registry_dir": str(registry_dir),
                    "sources": {"allowed_local_roots": [str(root)]}}
    replica = {k: v for k, v in args["replica"].items() if k != "autoscaling_config"}
    args["replica"] = {**replica, "num_replicas": replicas, "ray_actor_options": {"num_cpus": replica_cpus},
                       "graceful_shutdown_timeout_s": 2, "graceful_shutdown_wait_loop_s": 0.5}
    return args


def start(args: dict[str, Any], num_cpus: int) -> str:
    """A local Ray and the app on a free loopback port; returns the base URL once /health and /v1/models answer."""
    env = {"OMP_NUM_THREADS": "1"}
    if os.environ.get("LORAFLEET_CACHE"):
        env["LORAFLEET_CACHE"] = os.environ["LORAFLEET_CACHE"]
    port = free_port()
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
             namespace="lorafleet-soak", runtime_env={"env_vars": env})
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(args), name=APP, route_prefix="/", blocking=False)
    base = f"http://127.0.0.1:{port}"
    deadline, last = time.monotonic() + READY_TIMEOUT_S, None
    while time.monotonic() < deadline:
        try:  # the first /v1/models also registers the demo adapters
            if (httpx.get(f"{base}/health", timeout=5).status_code == 200
                    and httpx.get(f"{base}/v1/models", timeout=30).status_code == 200
                    and len(replica_actors()) == args["replica"]["num_replicas"]):
                return base
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(1)
    raise TimeoutError(f"the soak app was not ready within {READY_TIMEOUT_S:.0f} s (last error: {last!r})")


def stop() -> None:
    ray.shutdown()  # Serve ends with it (a serve.shutdown first only waits on the killed replicas)


def replica_actors() -> dict[str, Any]:
    """The app's LoRAReplica actors Serve lists, by replica id."""
    prefix = f"SERVE_REPLICA::{APP}#LoRAReplica#"
    actors = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].startswith(prefix):
            try:
                actors[a["name"].removeprefix(prefix)] = ray.get_actor(a["name"], namespace=a["namespace"])
            except ValueError:  # died meanwhile
                pass
    return actors


def running_replicas() -> int:
    status = serve.status().applications.get(APP)
    return 0 if status is None else status.deployments["LoRAReplica"].replica_states.get("RUNNING", 0)


def rss_mb(actor: Any) -> float | None:
    """The RSS of an actor's process and its children, in MB (None: gone)."""
    try:
        info = ray_state.actors(actor._actor_id.hex())
        if info["State"] != "ALIVE" or not info["Pid"]:
            return None
        proc = psutil.Process(info["Pid"])
        return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 2**20
    except (psutil.Error, KeyError):
        return None


def routing_stats() -> tuple[dict[str, dict], dict[str, str]]:
    """Each listed replica's record_routing_stats (what the router reads), and the replicas that did not answer
    (retried once) with their errors."""
    stats: dict[str, dict] = {}
    unanswered: dict[str, str] = {}
    for attempt in range(2):
        refs = {rid: a.record_routing_stats.remote() for rid, a in replica_actors().items()}
        stats, unanswered = {}, {}
        for rid, ref in refs.items():
            try:
                stats[rid] = ray.get(ref, timeout=RAY_CALL_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - a replica being replaced: retried, then reported
                unanswered[rid] = repr(exc)[:500]
        if not unanswered:
            break
        time.sleep(1)
    return stats, unanswered


def kill_busiest() -> str | None:
    """Kill the replica with the most requests in flight (Serve replaces it); its id, or None if none listed."""
    stats, _ = routing_stats()
    actors = replica_actors()
    if not actors:
        return None
    victim = max(actors, key=lambda rid: stats.get(rid, {}).get("queue_len", -1))
    ray.kill(actors[victim], no_restart=True)
    return victim


def consistency(base: str, base_model: str, believed: dict[str, str], registry_dir: Path,
                settle_s: float) -> dict[str, tuple[bool, str]]:
    """The registry as the client believes it (adapter name -> lora_path) against /v1/models, every replica's
    routing-stats adapters (given settle_s to drop unloaded ones: a replica does once no request uses them) and
    registry_dir's adapters.json. Each check: (holds, what was seen)."""
    r = httpx.get(f"{base}/v1/models", timeout=60)
    listed = {m["id"]: m["root"] for m in r.json()["data"] if m["id"] != base_model}
    out = {"/v1/models == believed": (listed == believed, f"listed {listed}, believed {believed}")}
    deadline = time.monotonic() + settle_s
    while True:
        stats, unanswered = routing_stats()
        held = {rid: set(s["gpu_adapters"]) | set(s["host_adapters"]) for rid, s in stats.items()}
        extra = {rid: sorted(h - set(believed)) for rid, h in held.items() if h - set(believed)}
        if (not extra and not unanswered) or time.monotonic() > deadline:
            break
        time.sleep(1)
    out["replicas' adapters <= registry"] = (bool(held) and not extra and not unanswered,
                                             f"outside the registry: {extra}, unanswered {unanswered}, "
                                             f"replicas {sorted(held)}")
    path = registry_dir / REGISTRY_FILE
    on_disk = json.loads(path.read_text())["adapters"] if path.is_file() else None
    out["adapters.json == /v1/models"] = (on_disk == listed, f"file {on_disk}, listed {listed}")
    return out


def retried_after_loss(base: str) -> float:
    """The ingress's lorafleet_requests_retried_after_replica_loss_total (NaN where /metrics lacks it)."""
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line.startswith("lorafleet_requests_retried_after_replica_loss_total "):
            return float(line.split()[1])
    return float("nan")


def demo_adapters() -> dict[str, Path]:
    from replicas.demo_checkpoint import ensure_demo_checkpoint

    return dict(ensure_demo_checkpoint().adapters)
