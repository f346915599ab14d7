"""Adapter-aware autoscaling (cluster/autoscaling.py): the decision on plain data, the Serve-facing policy on a
real AutoscalingContext, and the simulator's replicas coming and going under it (cluster/simulator/autoscale.py)."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.autoscaling import (AdapterAwareAutoscaler, AdapterAwarePolicy, AutoscalerConfig, AutoscalerConfigError,
                                 FleetMetrics, RecentAdapters, replica_autoscaling_stats)

ROOT = Path(__file__).resolve().parents[2]


def metrics(target=2, running=None, requests=0.0, working_set=0.0, pending_loads=0.0, lo=1, hi=8, **kw):
    return FleetMetrics(target=target, running=target if running is None else running, requests=requests,
                        working_set=working_set, pending_loads=pending_loads, max_num_seqs=64, max_loras=16,
                        min_replicas=lo, max_replicas=hi, **kw)


def scaler(**kw):
    return AdapterAwareAutoscaler(AutoscalerConfig(**{"downscale_delay_s": 100.0, **kw}))


# ---- the decision ----

def test_scales_up_on_queueing():
    # 2 replicas x 64 seqs x 0.7 = 89.6 requests before it wants more; 200 requests need ceil(200 / 44.8) = 5
    s = scaler()
    assert s.decide(0.0, metrics(requests=80)) == 2
    assert s.decide(1.0, metrics(requests=200)) == 5
    assert s.last_reason == "requests"


def test_scales_up_when_the_working_set_outgrows_the_slots():
    # 2 replicas x 16 slots x 0.95 = 30.4 adapters; few requests, 62 distinct adapters: ceil(62 / 15.2) = 5
    s = scaler()
    assert s.decide(0.0, metrics(requests=10, working_set=30)) == 2
    assert s.decide(1.0, metrics(requests=10, working_set=62)) == 5
    assert s.last_reason == "adapters"


def test_scales_up_one_replica_when_loads_pile_up():
    s = scaler(up_pending_loads=4.0)
    assert s.decide(0.0, metrics(pending_loads=8)) == 2  # 4 per replica: not above
    assert s.decide(1.0, metrics(pending_loads=9)) == 3
    assert s.last_reason == "loads"


def test_upscale_waits_its_delay_and_a_dip_restarts_it():
    s = scaler(upscale_delay_s=5.0)
    high = metrics(requests=200)
    assert s.decide(0.0, high) == 2
    assert s.decide(4.0, high) == 2
    assert s.decide(4.5, metrics(requests=10)) == 2  # the run of wishes broke
    assert s.decide(5.0, high) == 2
    assert s.decide(10.0, high) == 5


def test_a_rise_counts_when_reported_and_a_fall_once_the_mean_fell():
    s = scaler(downscale_delay_s=0.0)
    assert s.decide(0.0, metrics(requests=10, requests_now=200)) == 5  # a rise counts once reported
    # The means say 1 replica would do, the latest values say 4: nothing goes down
    s = scaler(downscale_delay_s=0.0)
    assert s.decide(0.0, metrics(target=4, requests=10, requests_now=150)) == 4


def test_downscales_only_after_a_sustained_low_period():
    s = scaler(downscale_delay_s=100.0)
    low = metrics(target=4, requests=20)  # fits 1 replica at 0.45 x 64
    assert s.decide(0.0, low) == 4
    assert s.decide(99.0, low) == 4
    assert s.decide(100.0, low) == 1
    assert s.last_reason == "low"


def test_a_break_in_the_low_period_restarts_the_downscale_timer():
    s = scaler(downscale_delay_s=100.0)
    low, mid = metrics(target=4, requests=20), metrics(target=4, requests=150)  # 150 needs 4 at 0.45 x 64 x 4
    assert s.decide(0.0, low) == 4
    assert s.decide(60.0, mid) == 4
    assert s.decide(120.0, low) == 4
    assert s.decide(219.0, low) == 4
    assert s.decide(220.0, low) == 1


def test_no_downscale_while_replicas_are_starting():
    s = scaler(downscale_delay_s=0.0)
    assert s.decide(0.0, metrics(target=4, running=2, requests=0)) == 4
    assert s.decide(1.0, metrics(target=4, running=4, requests=0)) == 1


def test_no_flapping_on_an_oscillating_input():
    """The load swings every 30 s between needing 4 replicas and fitting 2: up once, then it holds (the low
    half never lasts the downscale delay), and an input inside the band between the thresholds never moves it."""
    s = scaler(downscale_delay_s=120.0)
    target, changes = 2, 0
    for t in range(0, 1200):
        high = (t // 30) % 2 == 0
        new = s.decide(float(t), metrics(target=target, requests=150 if high else 50))
        changes += new != target
        target = new
    assert target == 4 and changes == 1
    # Inside the band: 100 requests on 3 replicas is below 0.7 x 64 x 3 = 134 and above 0.45 x 64 x 2 = 57.6
    s = scaler(downscale_delay_s=0.0)
    assert all(s.decide(float(t), metrics(target=3, requests=100 + 30 * (t % 2))) == 3 for t in range(100))


def test_bounds():
    s = scaler(downscale_delay_s=0.0)
    assert s.decide(0.0, metrics(target=2, requests=10_000, hi=6)) == 6
    assert s.decide(1.0, metrics(target=3, requests=0, lo=2)) == 2
    assert s.decide(2.0, metrics(target=1, requests=0, lo=2, hi=6)) == 2  # a target under the bounds is lifted
    assert scaler(max_step_up=1).decide(0.0, metrics(target=2, requests=10_000)) == 3


def test_configured_capacity_caps_the_reported_one():
    # max_ongoing_requests 32 under an engine of 64 seqs: 100 requests on 2 replicas need ceil(100 / 22.4) = 5
    s = scaler(max_num_seqs=32)
    assert s.decide(0.0, metrics(requests=100)) == 5
    # Nothing reported yet and nothing configured: the requests signal cannot count replicas
    s = scaler()
    m = FleetMetrics(target=2, running=2, requests=1e6, working_set=0, pending_loads=0, min_replicas=1,
                     max_replicas=8)
    assert s.decide(0.0, m) == 2


@pytest.mark.parametrize("kwargs", [dict(down_utilization=0.8), dict(up_slot_fill=0.0), dict(downscale_delay_s=-1),
                                    dict(down_slot_fill=0.95)])
def test_bad_knobs_are_typed_errors(kwargs):
    with pytest.raises(AutoscalerConfigError):
        AutoscalerConfig(**kwargs)
    with pytest.raises(AutoscalerConfigError, match="unknown policy_kwargs"):
        AdapterAwarePolicy(up_utilisation=0.5)


def test_recent_adapters_counts_distinct_names_in_the_window():
    now = [0.0]
    recent = RecentAdapters(10.0, clock=lambda: now[0])
    for t, name in [(0, "a"), (1, "b"), (2, "a"), (5, "c")]:
        now[0] = t
        recent.add(name)
    assert len(recent) == 3
    now[0] = 11.5  # b (last at 1) has left; a (last at 2) has not
    assert len(recent) == 2
    now[0] = 15.5
    assert len(recent) == 0


def test_the_module_imports_no_ray():
    """Serve pickles the policy's module by value for its controller: it must stand on the standard library."""
    code = "import sys, cluster.autoscaling; assert not [m for m in sys.modules if m.startswith('ray')]"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
    text = (ROOT / "cluster" / "autoscaling.py").read_text()
    assert "from cluster" not in text and "import cluster" not in text


# ---- the Serve-facing policy ----

def _context(policy_state=None, target=2, running=2, total=10.0, queued=0.0, per_replica=None, now=1000.0):
    from ray.serve._private.common import DeploymentID, ReplicaID
    from ray.serve._private.common import TimeStampedValue
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    dep = DeploymentID(name="LoRAReplica", app_name="lorafleet")
    ids = [ReplicaID(unique_id=f"r{i}", deployment_id=dep) for i in range(running)]
    per_replica = per_replica or [replica_autoscaling_stats(5, 5, 0, 4, 64, 16) for _ in ids]
    aggregated = {k: {rid: stats[k] for rid, stats in zip(ids, per_replica)} for k in per_replica[0]}
    raw = {k: {rid: [TimeStampedValue(now - 1, stats[k])] for rid, stats in zip(ids, per_replica)}
           for k in per_replica[0]}
    config = AutoscalingConfig(min_replicas=1, max_replicas=8, upscale_delay_s=0, downscale_delay_s=0)
    return AutoscalingContext(
        deployment_id=dep, deployment_name=dep.name, app_name=dep.app_name, current_num_replicas=running,
        target_num_replicas=target, running_replicas=ids, total_num_requests=total, total_queued_requests=queued,
        aggregated_metrics=aggregated, raw_metrics=raw, capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=8, policy_state=policy_state or {}, last_scale_up_time=None,
        last_scale_down_time=None, current_time=now, config=config)


def test_the_policy_on_a_serve_context():
    policy = AdapterAwarePolicy(downscale_delay_s=60.0)
    # Working set: 2 replicas x 20 distinct adapters = 40 > 0.9 x 32 slots: ceil(40 / 14.4) = 3
    busy = [replica_autoscaling_stats(8, 8, 1, 20, 64, 16)] * 2
    desired, state = policy(_context(per_replica=busy, total=16))
    assert desired == 3
    # Quiet: the low period starts, is kept in policy_state, and ends in a downscale 60 s later
    quiet = [replica_autoscaling_stats(0, 0, 0, 1, 64, 16)] * 3
    desired, state = policy(_context(state, target=3, running=3, total=0, per_replica=quiet, now=1000.0))
    assert desired == 3 and state["adapter_aware"]["down_since"] == 1000.0
    desired, state = policy(_context(state, target=3, running=3, total=0, per_replica=quiet, now=1060.0))
    assert desired == 1


def test_serve_resolves_and_wraps_the_policy():
    """What Serve's controller does with the config: import the class, instantiate it once with policy_kwargs,
    wrap it in its delay logic (0 here: the policy's own delays decide) and call it with the context."""
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve.autoscaling_policy import _apply_autoscaling_config
    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy

    config = AutoscalingConfig(min_replicas=1, max_replicas=8, upscale_delay_s=0, downscale_delay_s=0,
                               policy=AutoscalingPolicy(policy_function="cluster.autoscaling:AdapterAwarePolicy",
                                                        policy_kwargs={"up_slot_fill": 0.5, "down_slot_fill": 0.3}))
    policy = _apply_autoscaling_config(_resolve_policy_callable(config.policy))
    ctx = _context(per_replica=[replica_autoscaling_stats(4, 4, 0, 12, 64, 16)] * 2, total=8)
    desired, state = policy(ctx)
    assert desired == 3  # 24 adapters over 0.5 x 16 slots
    assert "adapter_aware" in state


def test_the_simulators_serve_delay_model_matches_serve():
    """cluster/simulator/autoscale.py's ServeDelayLogic against Ray's own scaling factors + delay logic, on a
    random walk of desired counts."""
    from ray.serve.autoscaling_policy import _apply_delay_logic, _apply_scaling_factors
    from ray.serve.config import AutoscalingConfig

    from cluster.simulator.autoscale import AutoscaleConfig, ServeDelayLogic

    rng = random.Random(0)
    for up, down, factor in ((30.0, 600.0, 1.0), (0.0, 5.0, 0.5), (3.0, 0.0, 2.0)):
        ray_cfg = AutoscalingConfig(min_replicas=1, max_replicas=10, upscale_delay_s=up, downscale_delay_s=down,
                                    upscaling_factor=factor, downscaling_factor=factor)
        ours = ServeDelayLogic(AutoscaleConfig(min_replicas=1, max_replicas=10, upscale_delay_s=up,
                                               downscale_delay_s=down, upscaling_factor=factor,
                                               downscaling_factor=factor))
        state: dict = {}
        target = 3
        for step in range(600):
            now = float(step)
            current = max(1, target - rng.randint(0, 1))
            desired = max(0.0, target + rng.uniform(-3, 3))
            scaled = _apply_scaling_factors(desired, current, ray_cfg)
            expected, state = _apply_delay_logic(max(0, scaled), target, ray_cfg, state, _now=now)
            expected = max(1, min(10, expected))
            assert ours.apply(now, desired, target, current) == expected, (step, up, down, factor)
            target = expected


# ---- the simulator ----

def _trace(seed=0, **kw):
    from cluster.simulator import WorkloadConfig, generate

    cfg = dict(duration_s=900.0, rate=10.0, num_adapters=100, zipf_s=1.0, diurnal_amplitude=0.8,
               diurnal_period_s=900.0, churn_every_s=60.0, output_median=64, max_output=256, seed=seed)
    cfg.update(kw)
    return generate(WorkloadConfig(**cfg))


def _cluster(policy="adapter-aware", **kw):
    from cluster.simulator import ClusterConfig, ReplicaConfig
    from cluster.simulator.autoscale import AutoscaleConfig

    auto = dict(policy=policy, min_replicas=1, max_replicas=6, initial_replicas=2, startup_s=30.0,
                upscale_delay_s=0.0, downscale_delay_s=0.0, scaler={"downscale_delay_s": 60.0})
    auto.update(kw)
    return ClusterConfig(replicas_per_node=2, replica=ReplicaConfig(max_loras=8, max_cpu_loras=16, max_num_seqs=16,
                                                                    max_ongoing=16),
                         autoscaling=AutoscaleConfig(**auto))


def test_the_simulator_drives_the_apps_autoscaler():
    from cluster.simulator import autoscale

    assert autoscale.autoscaler_class is AdapterAwareAutoscaler
    fleet_scaler = autoscale.Fleet.__init__.__code__.co_names
    assert "AdapterAwareAutoscaler" in fleet_scaler


@pytest.mark.parametrize("policy", ["adapter-aware", "serve"])
def test_replicas_come_and_go_and_nothing_is_lost(policy):
    from cluster.simulator.sim import run

    trace = _trace()
    kw = {} if policy == "adapter-aware" else dict(target_ongoing_requests=3.0, downscale_delay_s=60.0)
    report, log = run(trace, _cluster(policy, **kw), "ours", seed=0)
    counts = [n for _, n in log.changes]
    assert max(counts) > 2 and min(counts[1:]) < max(counts)  # up with the daily peak, down after it
    assert log.stopped > 0 and log.lost == 0
    assert report.completed == report.requests == len(trace)
    # Replica-hours integrate the live count: between the fewest and the most replicas over the run
    assert 1 <= report.replicas <= log.peak
    assert report.summary()["replica_h"] == pytest.approx(log.replica_s / 3600)


def test_autoscaled_runs_are_deterministic_per_seed():
    from cluster.simulator.sim import run

    trace = _trace(duration_s=300.0, diurnal_period_s=300.0)
    a, la = run(trace, _cluster(), "ours", seed=3)
    b, lb = run(trace, _cluster(), "ours", seed=3)
    assert a.ttft_s == b.ttft_s and a.tpot_s == b.tpot_s and la.changes == lb.changes
    assert a.summary() == b.summary()


def test_a_drain_past_the_graceful_timeout_loses_what_the_replica_held():
    """Serve kills a stopping replica at graceful_shutdown_timeout_s: long answers still running are lost, and
    counted, and the run still ends."""
    from cluster.simulator.sim import run

    trace = _trace(duration_s=120.0, diurnal_amplitude=0.0, rate=20.0, output_median=2000, max_output=4000)
    trace = [r for r in trace if r.arrival_s < 40.0]  # a burst of long answers, then nothing
    cfg = _cluster("serve", target_ongoing_requests=4.0, initial_replicas=6, startup_s=1.0,
                   graceful_shutdown_timeout_s=1.0, look_back_period_s=5.0, metrics_interval_s=1.0)
    report, log = run(trace, cfg, "ours", seed=0)
    assert log.lost > 0
    assert report.completed == report.requests - log.lost


def test_the_gpu_config_runs_this_policy():
    """deploy/config.gpu.yaml's autoscaling_config: Serve parses it, and its policy_kwargs build the policy."""
    import yaml
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve.config import AutoscalingConfig

    app = yaml.safe_load((ROOT / "deploy" / "config.gpu.yaml").read_text())["applications"][0]
    config = AutoscalingConfig(**app["args"]["replica"]["autoscaling_config"])
    assert config.upscale_delay_s == config.downscale_delay_s == 0  # Serve's delays would add to the policy's
    policy = _resolve_policy_callable(config.policy)
    assert isinstance(policy, AdapterAwarePolicy) and policy.config.max_num_seqs == 64


def test_replicas_and_the_simulator_count_adapters_over_one_window():
    """The working set a real replica reports (LoRAReplica's RecentAdapters) and the simulator's fleet's use the
    same window, ADAPTER_WINDOW_S: the policy's slot-fill thresholds mean the same in both."""
    from cluster.autoscaling import ADAPTER_WINDOW_S
    from cluster.simulator.autoscale import AutoscaleConfig

    assert RecentAdapters().window_s == AutoscaleConfig().adapter_window_s == ADAPTER_WINDOW_S
