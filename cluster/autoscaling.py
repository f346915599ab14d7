"""Adapter-aware autoscaling of the replica deployment: the decision on plain data, and Serve's policy around it.

    autoscaling_config:
      min_replicas: 1
      max_replicas: 8
      upscale_delay_s: 0          # the policy's own delays decide; Serve's would add to them
      downscale_delay_s: 0
      policy:
        policy_function: cluster.autoscaling:AdapterAwarePolicy
        policy_kwargs: {max_num_seqs: 64, downscale_delay_s: 60}   # AutoscalerConfig fields

A replica needs capacity for three things, and each gives a replica count:
  - requests: ongoing + queued requests against what replicas run at once (max_num_seqs);
  - adapters: the working set (distinct adapters each replica was asked for over ADAPTER_WINDOW_S, summed:
    a slot per adapter per replica that serves it) against the GPU slots (max_loras x replicas);
  - loads: adapter loads in flight per replica (a working set churning faster than the slots hold it).
The desired count is the largest. Hysteresis: up at `up_*` thresholds after `upscale_delay_s` (short), down only
when the load fits fewer replicas at the lower `down_*` thresholds for `downscale_delay_s` without a break, one
decision at a time; between the two nothing changes, so an input oscillating inside the band never flaps.

`AdapterAwareAutoscaler` is the decision, a plain class (no Ray): the cluster simulator
(cluster/simulator/autoscale.py) drives the same class. `AdapterAwarePolicy` is the Ray-facing callable: Serve
instantiates it once with `policy_kwargs` and calls it with an AutoscalingContext every control-loop tick; it keeps
the scaler's timers in `ctx.policy_state`. Replicas report the metrics in `record_autoscaling_stats`
(cluster/deployments.py, `replica_autoscaling_stats`). Serve pickles this module by value for its controller, so it
imports nothing but the standard library.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable, Mapping

# The metrics a replica reports (record_autoscaling_stats), averaged by Serve over look_back_period_s.
ONGOING, RUNNING, PENDING_LOADS, RECENT_ADAPTERS = "ongoing", "running", "pending_loads", "recent_adapters"
MAX_NUM_SEQS, MAX_LORAS = "max_num_seqs", "max_loras"
STATE_KEY = "adapter_aware"  # the scaler's timers in ctx.policy_state
# Replicas count the distinct adapters asked for over this window: about a request's life, so that the count is
# what the slots must hold at once.
ADAPTER_WINDOW_S = 2.0


class AutoscalerConfigError(ValueError):
    """An AutoscalerConfig field (a policy_kwargs entry) is unknown or out of range."""


@dataclass(frozen=True)
class AutoscalerConfig:
    """The policy's knobs (policy_kwargs). Utilizations are shares of what the replicas can hold."""

    up_utilization: float = 0.7  # ongoing + queued over (max_num_seqs x replicas): add replicas above this
    down_utilization: float = 0.45  # remove replicas only while the load fits fewer at this
    # Working set over (max_loras x replicas): add replicas above this. In the simulator a replica at the largest
    # request rate it sustains within the SLO reports 0.85-0.9 of its slots, and its queue absorbs the minute a
    # new replica takes to start: 0.95 adds replicas as the fleet reaches capacity; 0.9, before it, spent ~1.1 x
    # the replica-hours at the same attainment (bench/autoscale.py).
    up_slot_fill: float = 0.95
    # Remove only while the working set fits fewer replicas' slots at this: the rule counts the replica that goes
    # as taking its share of the working set with it, so the band below up_slot_fill is wider than it looks. 0.9
    # saved ~2% of the replica-hours but flapped between 1 and 2 replicas, where a 2 s window's count is noisiest.
    down_slot_fill: float = 0.8
    up_pending_loads: float = 4.0  # adapter loads in flight per replica, averaged: add one replica above this
    upscale_delay_s: float = 0.0  # the signal must hold this long before replicas are added
    downscale_delay_s: float = 60.0  # ... and the low period this long before one decision to remove
    max_step_up: int = 0  # replicas added per decision at most; 0: as many as the signals ask for
    # Per replica; where replicas report theirs too, the smaller counts (e.g. max_ongoing_requests below the
    # engine's max_num_seqs). 0: the reported values only.
    max_num_seqs: int = 0
    max_loras: int = 0

    def __post_init__(self) -> None:
        for name in ("up_utilization", "down_utilization", "up_slot_fill", "down_slot_fill"):
            if not getattr(self, name) > 0:
                raise AutoscalerConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.down_utilization >= self.up_utilization:
            raise AutoscalerConfigError(f"down_utilization ({self.down_utilization}) must be below up_utilization "
                                        f"({self.up_utilization}): the band between them is the hysteresis")
        if self.down_slot_fill >= self.up_slot_fill:
            raise AutoscalerConfigError(f"down_slot_fill ({self.down_slot_fill}) must be below up_slot_fill "
                                        f"({self.up_slot_fill})")
        for name in ("up_pending_loads", "upscale_delay_s", "downscale_delay_s", "max_step_up", "max_num_seqs",
                     "max_loras"):
            if getattr(self, name) < 0:
                raise AutoscalerConfigError(f"{name} must be >= 0, got {getattr(self, name)}")

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> "AutoscalerConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise AutoscalerConfigError(f"unknown policy_kwargs for AdapterAwarePolicy: {unknown}; "
                                        f"known: {sorted(known)}")
        return cls(**kwargs)


@dataclass(frozen=True)
class FleetMetrics:
    """What one decision sees: Serve's AutoscalingContext, or the simulator's equivalent."""

    target: int  # the replica count Serve aims at now (running + starting)
    running: int  # replicas running (reporting)
    requests: float  # ongoing at replicas + queued at the routers
    working_set: float  # sum over running replicas of their distinct recent adapters
    pending_loads: float  # adapter loads in flight, all replicas
    max_num_seqs: float = 0.0  # per replica, as reported (0: none yet)
    max_loras: float = 0.0
    min_replicas: int = 1
    max_replicas: int = 1
    # The same three from the latest reports rather than the look-back means (None: not known). Decisions take
    # the larger of the two: a rise counts as soon as it is reported, and a fall only once the mean has fallen too.
    requests_now: float | None = None
    working_set_now: float | None = None
    pending_loads_now: float | None = None

    def latest(self) -> "FleetMetrics":
        """These metrics with each signal at the larger of its mean and its latest value."""
        def hi(mean: float, now: float | None) -> float:
            return mean if now is None else max(mean, now)

        return dataclasses.replace(self, requests=hi(self.requests, self.requests_now),
                                   working_set=hi(self.working_set, self.working_set_now),
                                   pending_loads=hi(self.pending_loads, self.pending_loads_now))


@dataclass
class ScalerState:
    """The hysteresis timers: when the current run of up or down wishes began (None: no such run)."""

    up_since: float | None = None
    down_since: float | None = None

    def to_dict(self) -> dict[str, float | None]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "ScalerState":
        d = d or {}
        return cls(up_since=d.get("up_since"), down_since=d.get("down_since"))


class AdapterAwareAutoscaler:
    """decide(now, metrics) -> the replica count to aim at; see the module docstring for the rules."""

    def __init__(self, config: AutoscalerConfig | None = None, state: ScalerState | None = None) -> None:
        self.config = config or AutoscalerConfig()
        self.state = state or ScalerState()
        self.last_reason = "hold"  # what drove the last decision: requests, adapters, loads, hold, low

    def needs(self, m: FleetMetrics, utilization: float, slot_fill: float) -> dict[str, int]:
        """Replicas each signal asks for at the given thresholds."""
        c = self.config
        seqs = min(x for x in (m.max_num_seqs, c.max_num_seqs, math.inf) if x)
        slots = min(x for x in (m.max_loras, c.max_loras, math.inf) if x)
        seqs, slots = (0 if x == math.inf else x for x in (seqs, slots))
        out = {"requests": math.ceil(m.requests / (seqs * utilization)) if seqs else 0,
               "adapters": math.ceil(m.working_set / (slots * slot_fill)) if slots else 0}
        return out

    def decide(self, now: float, m: FleetMetrics) -> int:
        c, s = self.config, self.state
        lo, hi = m.min_replicas, max(m.min_replicas, m.max_replicas)
        target = min(max(m.target, lo), hi)
        rising = m.latest()
        up = self.needs(rising, c.up_utilization, c.up_slot_fill)
        # Loads piling up at the running replicas: one more replica spreads the working set thinner.
        per_replica_loads = rising.pending_loads / max(m.running, 1)
        up["loads"] = m.running + 1 if c.up_pending_loads and per_replica_loads > c.up_pending_loads else 0
        reason, want_up = max(up.items(), key=lambda kv: kv[1])
        want_up = min(want_up, hi)
        if want_up > target:
            s.down_since = None
            if s.up_since is None:
                s.up_since = now
            if now - s.up_since >= c.upscale_delay_s:
                s.up_since = None
                step = want_up - target
                self.last_reason = reason
                return target + (min(step, c.max_step_up) if c.max_step_up else step)
            self.last_reason = "hold"
            return target
        s.up_since = None
        down = self.needs(rising, c.down_utilization, c.down_slot_fill)
        want_down = max(max(down.values()), lo)
        if want_down < target and m.running >= target:  # never while replicas are still starting
            if s.down_since is None:
                s.down_since = now
            if now - s.down_since >= c.downscale_delay_s:
                s.down_since = None  # the next step down needs a whole low period of its own
                self.last_reason = "low"
                return want_down
        else:
            s.down_since = None
        self.last_reason = "hold"
        return target


class RecentAdapters:
    """The distinct adapters a replica was asked for over the last `window_s` seconds."""

    def __init__(self, window_s: float = ADAPTER_WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s, self._clock = window_s, clock
        self._seen: OrderedDict[str, float] = OrderedDict()  # adapter -> last asked, oldest first

    def add(self, adapter: str) -> None:
        self._seen[adapter] = self._clock()
        self._seen.move_to_end(adapter)

    def __len__(self) -> int:
        horizon = self._clock() - self.window_s
        seen = self._seen
        while seen and next(iter(seen.values())) < horizon:
            seen.popitem(last=False)
        return len(seen)


def replica_autoscaling_stats(ongoing: int, running: int, pending_loads: int, recent_adapters: int,
                              max_num_seqs: int, max_loras: int) -> dict[str, float]:
    """A replica's record_autoscaling_stats dict (numbers only: Serve rejects anything else)."""
    return {ONGOING: float(ongoing), RUNNING: float(running), PENDING_LOADS: float(pending_loads),
            RECENT_ADAPTERS: float(recent_adapters), MAX_NUM_SEQS: float(max_num_seqs), MAX_LORAS: float(max_loras)}


def fleet_metrics(ctx: Any) -> FleetMetrics:
    """FleetMetrics from Serve's AutoscalingContext (read by attribute: this module imports no Ray)."""
    per_replica = ctx.aggregated_metrics or {}

    def total(name: str) -> float:
        return float(sum(per_replica.get(name, {}).values()))

    def largest(name: str) -> float:
        return float(max(per_replica.get(name, {}).values(), default=0.0))

    raw = ctx.raw_metrics or {}

    def latest(name: str) -> float | None:
        """The sum of each running replica's latest reported value (None: no replica reported one)."""
        points = [series[-1].value for series in raw.get(name, {}).values() if series]
        return float(sum(points)) if points else None

    ongoing = latest(ONGOING)
    queued = ctx.total_queued_requests

    return FleetMetrics(target=ctx.target_num_replicas, running=ctx.current_num_replicas,
                        requests=float(ctx.total_num_requests), working_set=total(RECENT_ADAPTERS),
                        pending_loads=total(PENDING_LOADS), max_num_seqs=largest(MAX_NUM_SEQS),
                        max_loras=largest(MAX_LORAS), min_replicas=ctx.capacity_adjusted_min_replicas,
                        max_replicas=ctx.capacity_adjusted_max_replicas,
                        requests_now=None if ongoing is None else ongoing + float(queued or 0.0),
                        working_set_now=latest(RECENT_ADAPTERS), pending_loads_now=latest(PENDING_LOADS))


class AdapterAwarePolicy:
    """Serve's custom autoscaling policy (AutoscalingConfig.policy.policy_function); policy_kwargs are
    AutoscalerConfig fields. Serve instantiates it once and calls it every control-loop tick."""

    def __init__(self, **policy_kwargs: Any) -> None:
        self.config = AutoscalerConfig.from_kwargs(policy_kwargs)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        state = dict(ctx.policy_state or {})
        scaler = AdapterAwareAutoscaler(self.config, ScalerState.from_dict(state.get(STATE_KEY)))
        now = ctx.current_time if ctx.current_time is not None else time.time()
        desired = scaler.decide(now, fleet_metrics(ctx))
        state[STATE_KEY] = scaler.state.to_dict()
        return desired, state
