"""A discrete-event simulator of the cluster that runs the app's own policy objects (no Ray).

    from cluster.simulator import ClusterConfig, WorkloadConfig, generate, simulate
    report = simulate(generate(WorkloadConfig(rate=50)), ClusterConfig(replicas=8), "ours", seed=0)

docs/simulator.md says what it models and where its numbers come from.
The classes below are the app's, not copies: tests/cluster/test_simulator.py
checks that they are the very objects the Serve app uses.
"""

from cluster.adapter_tier import AdapterTier
from cluster.routing import AdapterAffinityPolicy, InflightTracker, ReplicaStats
from lora_core.host_cache import HostLRUCache

from cluster.simulator.autoscale import AutoscaleConfig, autoscaler_class
from cluster.simulator.calibration import ROWS, StepModel, TierCosts, fit, fit_table
from cluster.simulator.metrics import SLO, Report, table
from cluster.simulator.policies import POLICIES
from cluster.simulator.replica import ReplicaConfig
from cluster.simulator.sim import ClusterConfig, bound, bound_times, simulate
from cluster.simulator.workload import Request, WorkloadConfig, generate, read_trace, write_trace

# What the simulator drives; a test asserts each `is` the app's class.
routing_policy_class = AdapterAffinityPolicy
replica_stats_class = ReplicaStats
inflight_tracker_class = InflightTracker
host_cache_class = HostLRUCache  # host tier and GPU slots
adapter_tier_class = AdapterTier

__all__ = ["AdapterTier", "AutoscaleConfig", "autoscaler_class", "ClusterConfig", "POLICIES", "ROWS", "ReplicaConfig", "Report", "Request", "SLO",
           "StepModel", "TierCosts", "WorkloadConfig", "bound", "bound_times", "fit", "fit_table", "generate",
           "read_trace", "simulate", "table", "write_trace"]
