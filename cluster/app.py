"""build_app: the Serve application `serve run deploy/config.yaml` starts.

args (all optional; see deploy/config.yaml):
    server:   ServerConfig fields (model, served_model_name, engine: EngineArgs fields, ...)
    tier:     adapter-tier actor settings (capacity_bytes, registry_dir, sources: SourceSettings fields)
    replica:  Serve options of the engine deployment (num_replicas or autoscaling_config,
              ray_actor_options, max_ongoing_requests, ...)
    ingress:  Serve options of the HTTP deployment
    api_keys: list of accepted API keys (off when empty; gRPC callers send `authorization: Bearer <key>` metadata)

gRPC: the ingress also serves cluster/proto/lorafleet.proto (LoRAFleet.Generate, LoRAFleet.ListAdapters) once
Serve's gRPC proxy knows the servicer, e.g. `serve.start(grpc_options={"port": 9000,
"grpc_servicer_functions": GRPC_SERVICER_FUNCTIONS})` or, in a Serve config file,
`grpc_options: {port: 9000, grpc_servicer_functions: ["cluster.proto.lorafleet_pb2_grpc.add_LoRAFleetServicer_to_server"]}`.
Clients pick the app with the `application` metadata key.
"""

from __future__ import annotations

import os
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from cluster.deployments import Ingress, LoRAReplica
from cluster.grpc_ingress import GRPC_SERVICER_FUNCTIONS
from replicas.engine_args import EngineArgs

__all__ = ["build_app", "GRPC_SERVICER_FUNCTIONS"]

DEFAULT_TIER = dict(capacity_bytes=2 << 30, registry_dir=os.path.expanduser("~/.cache/lorafleet/registry"))
# The ingress only relays streams, so one holds many at once; Serve's default of 5 queued a sixth concurrent
# request behind the first five's whole answers (bench/serve_stream.py: 16 streams, TTFT p50 0.9 s against 17 ms
# on the engine alone).
INGRESS_MAX_ONGOING = 1024
REPLICA_GRACEFUL_SHUTDOWN_S = 60.0


def tensor_parallel_options(server: dict[str, Any], replica_options: dict[str, Any]) -> None:
    """TP > 1: ranks 1.. run as Ray actors in the replica's placement group, one bundle per rank."""
    engine = server.setdefault("engine", {})
    tp = int(engine.get("tensor_parallel_size", 1))
    if tp <= 1:
        return
    engine.setdefault("distributed_executor_backend", "cluster.ray_executor:RayExecutor")
    if "placement_group_bundles" not in replica_options:
        actor = replica_options.get("ray_actor_options", {})
        unit = {"CPU": float(actor.get("num_cpus", 1))}
        if actor.get("num_gpus"):
            unit["GPU"] = float(actor["num_gpus"])
        replica_options["placement_group_bundles"] = [dict(unit) for _ in range(tp)]
        replica_options.setdefault("placement_group_strategy", "STRICT_PACK")


def build_app(args: dict[str, Any] | None = None):
    args = dict(args or {})
    server = dict(args.get("server") or {"model": "demo"})
    tier = {**DEFAULT_TIER, **(args.get("tier") or {})}
    replica_options = dict(args.get("replica") or {})
    # a replica takes as many requests as its engine batches, not Serve's default of 5 (a batch of 5 at most)
    replica_options.setdefault("max_ongoing_requests", int((server.get("engine") or {}).get(
        "max_num_seqs", EngineArgs.max_num_seqs)))
    # a replica removed (downscale, redeploy) lets its running answers finish: Serve's default, 20 s, cut
    # streams of a few hundred tokens at a busy replica's pace
    replica_options.setdefault("graceful_shutdown_timeout_s", REPLICA_GRACEFUL_SHUTDOWN_S)
    autoscaling = replica_options.get("autoscaling_config")
    if isinstance(autoscaling, dict) and "target_ongoing_requests" not in autoscaling:
        # the router's busy point, not Serve's default of 2 (a replica added for every 2 requests)
        replica_options["autoscaling_config"] = {
            **autoscaling, "target_ongoing_requests": max(1, replica_options["max_ongoing_requests"] // 2)}
    tensor_parallel_options(server, replica_options)
    router = RequestRouterConfig(
        request_router_class="cluster.router.AdapterAffinityRouter",
        request_router_kwargs=dict(replica_options.pop("router", {})),  # busy_fraction, pending_ttl_s, ...
        request_routing_stats_period_s=float(replica_options.pop("routing_stats_period_s", 1.0)))
    replica = serve.deployment(LoRAReplica, name="LoRAReplica").options(
        request_router_config=router, **replica_options)
    ingress_options = {"max_ongoing_requests": INGRESS_MAX_ONGOING, **(args.get("ingress") or {})}
    ingress = serve.deployment(Ingress, name="Ingress").options(**ingress_options)
    return ingress.bind(replica.bind(server, tier), server, tier, args.get("api_keys"))
