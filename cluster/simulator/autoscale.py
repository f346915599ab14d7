"""Replicas that come and go: Serve's autoscaling loop around either policy, on simulated replicas.

Policies:
  - "adapter-aware": cluster.autoscaling.AdapterAwareAutoscaler, the class the Serve app's policy runs;
  - "serve": Serve's default request-count policy (ray/serve/autoscaling_policy.py,
    replica_queue_length_autoscaling_policy): total ongoing requests / target_ongoing_requests.
Both run inside the same model of Serve's wrapper (`ServeDelayLogic`: the scaling factors, upscale_delay_s /
downscale_delay_s measured from the first of a run of same-direction wishes, then min/max), and see the same
metrics pipeline: each replica's numbers recorded every `record_interval_s`, visible to the controller once pushed
(every `metrics_interval_s`), averaged over `look_back_period_s`; a decision every `decision_period_s`.

Lifecycle. A replica added starts after `startup_s` (it costs from the moment it is asked for: it holds its
GPUs while it loads). A replica removed is chosen as Serve chooses (deployment_scheduler._get_replicas_to_stop):
one still starting first, then one on the node with the fewest replicas, the newest first. It drains: the router
sends it nothing more, it finishes what it holds and stops at the next `graceful_shutdown_wait_loop_s` tick once
empty; past `graceful_shutdown_timeout_s` whatever it still holds is lost (counted in FleetLog.lost).
Replica-seconds integrate the live count (starting, running, draining) until the last request finished.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Callable

from cluster.autoscaling import (ADAPTER_WINDOW_S, AdapterAwareAutoscaler, AutoscalerConfig, AutoscalerConfigError,
                                 FleetMetrics, RecentAdapters)

from cluster.simulator.events import EventLoop
from cluster.simulator.metrics import Report
from cluster.simulator.replica import SimReplica, SimRequest

POLICIES = ("adapter-aware", "serve")
STARTING, RUNNING, DRAINING, STOPPED = "starting", "running", "draining", "stopped"

# What the simulator drives; a test asserts it `is` the Serve app's class.
autoscaler_class = AdapterAwareAutoscaler


@dataclass
class AutoscaleConfig:
    policy: str = "adapter-aware"  # or "serve"
    min_replicas: int = 1
    max_replicas: int = 8
    initial_replicas: int | None = None  # None: min_replicas
    startup_s: float = 60.0  # asked for -> routable (a GPU replica loads its model, compiles, captures graphs)
    # Serve's AutoscalingConfig, as both policies see it
    target_ongoing_requests: float = 2.0  # the "serve" policy's target
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    upscaling_factor: float = 1.0
    downscaling_factor: float = 1.0
    look_back_period_s: float = 30.0
    metrics_interval_s: float = 10.0  # replicas' and handles' push period
    decision_period_s: float = 1.0  # Serve's control loop runs every 0.1 s; a second is as good here
    graceful_shutdown_wait_loop_s: float = 2.0
    graceful_shutdown_timeout_s: float = 60.0
    scaler: dict = field(default_factory=dict)  # AutoscalerConfig fields (the app's policy_kwargs)
    adapter_window_s: float = ADAPTER_WINDOW_S  # replicas' distinct-adapter window (LoRAReplica's)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown autoscaling policy {self.policy!r}; one of {POLICIES}")
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(f"need 0 <= min_replicas ({self.min_replicas}) <= max_replicas ({self.max_replicas})")

    @property
    def record_interval_s(self) -> float:
        # RAY_SERVE_AUTOSCALING_METRIC_RECORD_INTERVAL_FACTOR (0.2) of the look-back, at most the push period
        return min(self.look_back_period_s * 0.2, self.metrics_interval_s)


def adapter_aware_config(**common) -> AutoscaleConfig:
    """The adapter-aware policy as deploy/config.gpu.yaml runs it: Serve's own delays at 0, because Serve applies
    them on top of a custom policy and the policy's own (AutoscalerConfig's) decide."""
    return AutoscaleConfig(policy="adapter-aware", upscale_delay_s=0.0, downscale_delay_s=0.0, **common)


def parse_scaler(text: str) -> dict:
    """AutoscalerConfig overrides (the app's policy_kwargs) from "key=value,key=value", checked at once so that a
    typo fails before a run rather than inside one."""
    defaults = {f.name: f.default for f in fields(AutoscalerConfig)}
    kwargs: dict = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = (x.strip() for x in item.partition("="))
        if not sep or key not in defaults:
            raise AutoscalerConfigError(f"scaler setting {item!r}: want key=value, key one of {sorted(defaults)}")
        try:
            kwargs[key] = int(value) if isinstance(defaults[key], int) else float(value)
        except ValueError:
            raise AutoscalerConfigError(f"scaler setting {item!r}: {value!r} is not a number of its type") from None
    AutoscalerConfig.from_kwargs(kwargs)  # the ranges
    return kwargs


class ServeDelayLogic:
    """Serve's wrapper around any policy (ray/serve/autoscaling_policy.py: _apply_scaling_factors, then
    _apply_delay_logic against the current target, then the deployment's bounds)."""

    def __init__(self, cfg: AutoscaleConfig) -> None:
        self.cfg = cfg
        self.counter = 0  # >0: a run of upscale wishes, <0: of downscale wishes
        self.since: float | None = None

    def apply(self, now: float, desired: float, target: int, current: int) -> int:
        cfg = self.cfg
        if current == 0:
            scaled = math.ceil(desired)
        else:
            delta = desired - current
            factor = cfg.upscaling_factor if delta > 0 else cfg.downscaling_factor
            scaled = math.ceil(current + factor * delta)
            if math.ceil(desired) < current and scaled == current:
                scaled -= 1
        decision = target
        if scaled > target:
            if self.counter < 0:
                self.counter, self.since = 0, None
            self.counter += 1
            if self.since is None:
                self.since = now
            if now - self.since + 1e-6 >= cfg.upscale_delay_s:
                self.counter, self.since, decision = 0, None, scaled
        elif scaled < target:
            if self.counter > 0:
                self.counter, self.since = 0, None
            self.counter -= 1
            if self.since is None:
                self.since = now
            if target != 1:
                scaled = max(1, scaled)
            if now - self.since + 1e-6 >= cfg.downscale_delay_s:
                self.counter, self.since, decision = 0, None, scaled
        else:
            self.counter, self.since = 0, None
        return max(cfg.min_replicas, min(cfg.max_replicas, decision))


class ScalableReplica(SimReplica):
    """A SimReplica that the router may only use while it runs, and that counts the adapters it was asked for."""

    def __init__(self, *args, adapter_window_s: float = ADAPTER_WINDOW_S, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.state = STARTING
        self.recent = RecentAdapters(adapter_window_s, clock=self.loop.clock)

    def accepts(self) -> bool:
        return self.state == RUNNING and super().accepts()

    def accept(self, r: SimRequest) -> None:
        if r.req.adapter is not None:
            self.recent.add(r.req.adapter)
        super().accept(r)

    def held(self) -> list[SimRequest]:
        return [*self.running, *self.waiting]


@dataclass
class FleetLog:
    """What the autoscaler did: (time, live replicas after) per change, and the requests lost to a drain."""

    changes: list[tuple[float, int]] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)
    lost: int = 0
    peak: int = 0
    replica_s: float = 0.0
    started: int = 0
    stopped: int = 0


def fleet_summary(report: Report, log: FleetLog) -> dict:
    """An autoscaled run's Report.summary(), plus what the autoscaler did: the peak live replicas, the changes of
    the live count, and the requests lost (never answered: dropped at a drain's timeout, or unfinished)."""
    changes = sum(1 for a, b in zip(log.changes, log.changes[1:]) if a[1] != b[1])
    return {**report.summary(), "peak": log.peak, "changes": changes, "lost": report.requests - report.completed}


class Fleet:
    """The live replicas and Serve's controller loop over them. `replicas` is the router's list: position ==
    replica index, and the routers cache per-position stats between polls, so the list is made once with room
    for twice max_replicas (draining replicas hold a place while new ones start), stopped places are reused
    (the router's per-replica memory is told to forget the old one through `reset_index`), and in the rare
    case it must grow the router is told to poll afresh (`grown`)."""

    def __init__(self, cfg: AutoscaleConfig, loop: EventLoop, make_replica: Callable[[int], ScalableReplica],
                 route_waiting: Callable[[], None], router_queue: Callable[[], int],
                 on_lost: Callable[[SimRequest], None], reset_index: Callable[[int], None], grown: Callable[[], None],
                 replicas_per_node: int, max_num_seqs: int, max_loras: int, finished: Callable[[], bool]) -> None:
        self.cfg, self.loop = cfg, loop
        self._make, self._route_waiting, self._router_queue = make_replica, route_waiting, router_queue
        self._on_lost, self._reset_index, self._grown, self._finished = on_lost, reset_index, grown, finished
        self.per_node, self.max_num_seqs, self.max_loras = replicas_per_node, max_num_seqs, max_loras
        self.replicas: list[ScalableReplica] = []
        for i in range(2 * cfg.max_replicas):
            self.replicas.append(make_replica(i))
            self.replicas[-1].state = STOPPED
        self.log = FleetLog()
        self.delay = ServeDelayLogic(cfg)
        self.scaler = AdapterAwareAutoscaler(AutoscalerConfig.from_kwargs(cfg.scaler))
        self.target = 0
        self._order = 0  # start order: the newest replicas stop first
        self._born: dict[int, int] = {}
        self._samples: list[tuple[float, float, dict[int, tuple[int, int, int, int]]]] = []
        self._last_change = 0.0

    # ---- lifecycle ----

    def start(self) -> None:
        initial = self.cfg.initial_replicas if self.cfg.initial_replicas is not None else self.cfg.min_replicas
        self._scale_to(max(self.cfg.min_replicas, min(self.cfg.max_replicas, initial)))
        for rep in self.replicas:  # the initial replicas are up when the trace starts
            if rep.state == STARTING:
                rep.state = RUNNING
        self.loop.at(0.0, self._record)
        self.loop.at(self.cfg.decision_period_s, self._decide)

    def live(self) -> list[ScalableReplica]:
        return [r for r in self.replicas if r.state != STOPPED]

    def _account(self) -> None:
        now = self.loop.now
        self.log.replica_s += len(self.live()) * (now - self._last_change)
        self._last_change = now

    def close(self, end_s: float) -> None:
        """Integrate replica-seconds up to `end_s` (when the last request finished)."""
        self.log.replica_s += len(self.live()) * max(0.0, end_s - self._last_change)
        self._last_change = end_s

    def _scale_to(self, n: int) -> None:
        self._account()
        active = [r for r in self.replicas if r.state in (STARTING, RUNNING)]
        for _ in range(n - len(active)):
            self._add()
        if n < len(active):
            for rep in self._victims(active, len(active) - n):
                self._remove(rep)
        self.target = n
        self.log.peak = max(self.log.peak, len(self.live()))
        self.log.changes.append((self.loop.now, len(self.live())))

    def _add(self) -> None:
        index = next((r.index for r in self.replicas if r.state == STOPPED), len(self.replicas))
        rep = self._make(index)
        self._reset_index(index)
        if index == len(self.replicas):
            self.replicas.append(rep)
            self._grown()
        else:
            self.replicas[index] = rep
        self._order += 1
        self._born[index] = self._order
        self.log.started += 1
        self.loop.after(self.cfg.startup_s, self._started, rep)

    def _started(self, rep: ScalableReplica) -> None:
        if rep.state != STARTING:
            return  # stopped before it started
        rep.state = RUNNING
        self._route_waiting()

    def _victims(self, active: list[ScalableReplica], k: int) -> list[ScalableReplica]:
        per_node: dict[int, int] = {}
        for r in self.live():
            per_node[r.node] = per_node.get(r.node, 0) + 1
        key = lambda r: (r.state != STARTING, per_node[r.node], -self._born[r.index])  # noqa: E731
        return sorted(active, key=key)[:k]

    def _remove(self, rep: ScalableReplica) -> None:
        self.log.stopped += 1
        if rep.state == STARTING:
            rep.state = STOPPED
            return
        rep.state = DRAINING
        self.loop.after(self.cfg.graceful_shutdown_wait_loop_s, self._drain_check, rep, self.loop.now)

    def _drain_check(self, rep: ScalableReplica, since: float) -> None:
        if rep.state != DRAINING:
            return
        if rep.queue_len and self.loop.now - since < self.cfg.graceful_shutdown_timeout_s:
            self.loop.after(self.cfg.graceful_shutdown_wait_loop_s, self._drain_check, rep, since)
            return
        lost = rep.held()
        self._account()
        rep.state = STOPPED
        self.log.changes.append((self.loop.now, len(self.live())))
        if lost:  # Serve kills the actor at the timeout: its requests end without an answer
            self.log.lost += len(lost)
            rep.running, rep.waiting = [], type(rep.waiting)()
            rep._version += 1  # its pending step events are a dead replica's
            for r in lost:
                self._on_lost(r)

    # ---- Serve's controller ----

    def _record(self) -> None:
        """Each running replica's numbers (what record_autoscaling_stats returns) and the router's queue."""
        per = {r.index: (r.queue_len, len(r.running), len(r.loading), len(r.recent))
               for r in self.replicas if r.state == RUNNING}
        self._samples.append((self.loop.now, float(self._router_queue()), per))
        horizon = self.loop.now - self.cfg.look_back_period_s - self.cfg.metrics_interval_s
        while self._samples and self._samples[0][0] < horizon:
            self._samples.pop(0)
        if not self._finished():
            self.loop.after(self.cfg.record_interval_s, self._record)

    def _visible(self) -> list[tuple[float, float, dict[int, tuple[int, int, int, int]]]]:
        now, cfg = self.loop.now, self.cfg
        pushed = math.floor(now / cfg.metrics_interval_s) * cfg.metrics_interval_s
        return [s for s in self._samples if now - cfg.look_back_period_s < s[0] <= pushed]

    def metrics(self) -> FleetMetrics:
        """What Serve's AutoscalingContext carries: each running replica's look-back means, summed, and the
        latest pushed values (raw_metrics' last points)."""
        running = [r for r in self.replicas if r.state == RUNNING]
        visible = self._visible()
        samples = visible or self._samples[-1:]

        def totals(sample) -> tuple[float, float, float, float]:  # queued at the router, ongoing, adapters, loads
            _, queued, per = sample
            vals = [per[r.index] for r in running if r.index in per]
            return (queued, float(sum(v[0] for v in vals)), float(sum(v[3] for v in vals)),
                    float(sum(v[2] for v in vals)))

        if not samples:
            return FleetMetrics(target=self.target, running=len(running), requests=0.0, working_set=0.0,
                                pending_loads=0.0, max_num_seqs=self.max_num_seqs, max_loras=self.max_loras,
                                min_replicas=self.cfg.min_replicas, max_replicas=self.cfg.max_replicas)
        queued, ongoing, adapters, loads = (sum(col) / len(samples) for col in zip(*map(totals, samples)))
        _, ongoing_now, adapters_now, loads_now = totals(samples[-1])
        # Serve gives the handles' queue only as a look-back mean (total_queued_requests)
        return FleetMetrics(target=self.target, running=len(running), requests=queued + ongoing,
                            working_set=adapters, pending_loads=loads, max_num_seqs=self.max_num_seqs,
                            max_loras=self.max_loras, min_replicas=self.cfg.min_replicas,
                            max_replicas=self.cfg.max_replicas, requests_now=queued + ongoing_now,
                            working_set_now=adapters_now, pending_loads_now=loads_now)

    def _decide(self) -> None:
        now, cfg = self.loop.now, self.cfg
        m = self.metrics()
        if cfg.policy == "serve":
            desired: float = m.requests / cfg.target_ongoing_requests if m.running else self.target
            reason = "requests"
        else:
            desired = self.scaler.decide(now, m)
            reason = self.scaler.last_reason
        new = self.delay.apply(now, desired, self.target, m.running)
        if new != self.target:
            self.log.reasons[reason if new > self.target else "low"] = \
                self.log.reasons.get(reason if new > self.target else "low", 0) + 1
            self._scale_to(new)
        if not self._finished():
            self.loop.after(cfg.decision_period_s, self._decide)
