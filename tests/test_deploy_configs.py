"""deploy/: every YAML parses, the Serve configs validate against Ray Serve's schema, and the cluster-launcher
YAML against the Ray autoscaler's. Fast: no Ray cluster is started."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
SERVE_CONFIGS = ["config.yaml", "config.gpu.yaml"]


def _load(name: str):
    return yaml.safe_load((DEPLOY / name).read_text(encoding="utf-8"))


def _serve_schema(config: dict):
    from ray.serve.schema import ServeDeploySchema

    with warnings.catch_warnings():  # parse_obj is pydantic v1's name; the brief and `serve deploy` use it
        warnings.simplefilter("ignore", DeprecationWarning)
        return ServeDeploySchema.parse_obj(config)


def _rayservice_serve_config() -> dict:
    manifest = _load("kuberay-rayservice.yaml")
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    assert isinstance(manifest["spec"]["serveConfigV2"], str)  # KubeRay takes the Serve config as a string
    return yaml.safe_load(manifest["spec"]["serveConfigV2"])


@pytest.mark.parametrize("name", sorted(p.name for p in DEPLOY.glob("*.yaml")))
def test_yaml_parses(name):
    assert isinstance(_load(name), dict)


@pytest.mark.parametrize("name", SERVE_CONFIGS)
def test_serve_config_validates(name):
    schema = _serve_schema(_load(name))
    assert [app.name for app in schema.applications] == ["lorafleet"]
    assert schema.applications[0].import_path == "cluster.app:build_app"


def test_rayservice_serve_config_validates():
    schema = _serve_schema(_rayservice_serve_config())
    assert [app.name for app in schema.applications] == ["lorafleet"]


def test_rayservice_embeds_the_gpu_config():
    assert _rayservice_serve_config() == _load("config.gpu.yaml")


def test_rayservice_cluster_autoscales():
    cluster = _load("kuberay-rayservice.yaml")["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    (gpu,) = cluster["workerGroupSpecs"]
    assert 0 <= gpu["minReplicas"] <= gpu["replicas"] <= gpu["maxReplicas"]
    (container,) = gpu["template"]["spec"]["containers"]
    # A pod holds one whole replica: its placement group is STRICT_PACK (all ranks on one node).
    args = _load("config.gpu.yaml")["applications"][0]["args"]
    per_replica = args["server"]["engine"]["tensor_parallel_size"] * args["replica"]["ray_actor_options"]["num_gpus"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == per_replica == 2


def test_cluster_launcher_validates():
    import jsonschema
    import ray.autoscaler

    config = _load("cluster-launcher.yaml")
    schema_path = os.path.join(os.path.dirname(ray.autoscaler.__file__), "ray-schema.json")
    with open(schema_path, encoding="utf-8") as f:
        jsonschema.validate(config, json.load(f))
    # The checks ray.autoscaler's validate_config adds to the schema.
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    assert sum(t.get("min_workers", 0) for t in types.values()) <= config["max_workers"]
    assert any("serve deploy" in cmd and "deploy/config.gpu.yaml" in cmd for cmd in config["head_start_ray_commands"])


def _deployments(args):
    """build_app(args)'s (Ingress, LoRAReplica) deployments, as Serve would run them (nothing starts)."""
    from cluster.app import build_app

    ingress = build_app(args)._bound_deployment
    return ingress, ingress.init_args[0]._bound_deployment  # the LoRAReplica the ingress is bound to


def test_the_ingress_and_replicas_take_more_than_serves_five_unless_told_otherwise():
    """Serve's default max_ongoing_requests (5) would queue the sixth concurrent stream at the ingress, and cap
    each replica's batch at 5: the ingress takes INGRESS_MAX_ONGOING, a replica its engine's max_num_seqs."""
    from cluster.app import INGRESS_MAX_ONGOING
    from replicas.engine_args import EngineArgs

    def limits(args):
        ingress, replica = _deployments(args)
        return ingress.max_ongoing_requests, replica.max_ongoing_requests

    assert limits(None) == (INGRESS_MAX_ONGOING, EngineArgs.max_num_seqs) and INGRESS_MAX_ONGOING >= 256
    assert limits({"server": {"model": "demo", "engine": {"max_num_seqs": 24}}}) == (INGRESS_MAX_ONGOING, 24)
    assert limits({"ingress": {"max_ongoing_requests": 32}, "replica": {"max_ongoing_requests": 8}}) == (32, 8)


def test_a_removed_replica_lets_running_answers_finish_unless_told_otherwise():
    """Serve's default (20 s) would cut a busy replica's longer streams when autoscaling removes it."""
    from cluster.app import REPLICA_GRACEFUL_SHUTDOWN_S

    def grace(replica):
        return _deployments({"replica": replica})[1]._deployment_config.graceful_shutdown_timeout_s

    assert grace({}) == REPLICA_GRACEFUL_SHUTDOWN_S > 20
    assert grace({"graceful_shutdown_timeout_s": 2}) == 2


@pytest.mark.parametrize("given,target", [({}, 32), ({"target_ongoing_requests": 5}, 5)])
def test_autoscaling_aims_at_the_routers_busy_point_unless_told_otherwise(given, target):
    """Serve's default target (2 requests a replica) would add a replica for every 2 requests of a batching
    engine; unset, the target is half of max_ongoing_requests (where the router calls a replica busy)."""
    args = {"replica": {"max_ongoing_requests": 64, "autoscaling_config": {"min_replicas": 1, "max_replicas": 4,
                                                                         **given}}}
    replica = _deployments(args)[1]
    assert replica._deployment_config.autoscaling_config.target_ongoing_requests == target


@pytest.mark.parametrize("name", SERVE_CONFIGS)
def test_app_args_match_the_code(name):
    """The args name real fields: build_app takes them (Serve options), and ServerConfig, EngineArgs and
    SourceSettings accept theirs. Builds the application graph only; nothing starts."""
    from cluster.app import build_app
    from cluster.server_config import ServerConfig
    from cluster.sources import SourceSettings

    args = _load(name)["applications"][0]["args"]
    build_app(args)
    ServerConfig(**args["server"]).engine_args("/models/any")
    sources = dict(args["tier"].get("sources") or {})
    sources["allowed_local_roots"] = [os.path.expanduser(r) for r in sources.get("allowed_local_roots", [])]
    SourceSettings(**sources)
    assert set(args) <= {"server", "tier", "replica", "ingress", "api_keys"}


def test_the_demo_fits_a_two_core_machine_at_its_most_replicas():
    """Every CPU the demo app asks for at max_replicas, ingress included, fits the 2 cores the demo promises: a
    replica that cannot be scheduled waits for good, with Serve's "took more than 30s to be scheduled"."""
    app = _load("config.yaml")["applications"][0]["args"]
    replica, ingress = app["replica"], app["ingress"]
    most = replica["autoscaling_config"]["max_replicas"]
    asked = most * replica["ray_actor_options"]["num_cpus"] + ingress["ray_actor_options"]["num_cpus"]
    assert asked <= 2, asked
