"""Report: what one policy's run measured, and the bound's figures for the same trace."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SLO:
    ttft_s: float = 2.0
    tpot_s: float = 0.100

    def met(self, ttft: float, tpot: float) -> bool:
        return ttft <= self.ttft_s and tpot <= self.tpot_s


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); nan for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


@dataclass
class Report:
    policy: str
    requests: int
    completed: int
    ttft_s: list[float] = field(repr=False)  # per request, in trace order (nan: not finished)
    tpot_s: list[float] = field(repr=False)
    slo: SLO
    duration_s: float  # the trace's span: goodput's denominator
    end_s: float  # when the last request finished: replica-hours'
    replicas: int
    busy_s: float
    origin_fetches: int = 0
    store_reads_same_node: int = 0
    store_reads_other_node: int = 0
    disk_reads: int = 0
    host_loads: int = 0
    slot_loads: int = 0
    decisions: dict = field(default_factory=dict)
    events: int = 0

    def _done(self, xs: list[float]) -> list[float]:
        return [x for x in xs if not math.isnan(x)]

    @property
    def slo_met(self) -> int:
        return sum(1 for a, b in zip(self.ttft_s, self.tpot_s)
                   if not math.isnan(a) and self.slo.met(a, b))

    def summary(self) -> dict:
        ttft, tpot = self._done(self.ttft_s), self._done(self.tpot_s)
        return {
            "policy": self.policy, "requests": self.requests, "completed": self.completed,
            "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "tpot_p50": percentile(tpot, 50), "tpot_p99": percentile(tpot, 99),
            "slo": self.slo_met / max(self.requests, 1),
            "goodput": self.slo_met / self.duration_s if self.duration_s > 0 else math.nan,
            "busy": self.busy_s / (self.replicas * self.end_s) if self.end_s > 0 else 0.0,
            "origin": self.origin_fetches, "store_same": self.store_reads_same_node,
            "store_other": self.store_reads_other_node, "disk": self.disk_reads,
            "host_loads": self.host_loads, "slot_loads": self.slot_loads,
            "replica_h": self.replicas * self.end_s / 3600.0,
        } if self.policy != "bound" else {
            **{k: None for k in ("origin", "store_same", "store_other", "disk", "host_loads", "slot_loads",
                                 "busy", "replica_h")},
            "policy": "bound", "requests": self.requests, "completed": self.completed,
            "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "tpot_p50": percentile(tpot, 50), "tpot_p99": percentile(tpot, 99),
            "slo": self.slo_met / max(self.requests, 1),
            "goodput": self.slo_met / self.duration_s if self.duration_s > 0 else math.nan}


COLUMNS = [("policy", "{:<14}", 14), ("ttft_p50", "{:>9.3f}", 9), ("ttft_p99", "{:>9.3f}", 9),
           ("tpot_p50", "{:>9.4f}", 9), ("tpot_p99", "{:>9.4f}", 9), ("slo", "{:>6.3f}", 6),
           ("goodput", "{:>8.2f}", 8), ("origin", "{:>7}", 7), ("store_same", "{:>10}", 10),
           ("store_other", "{:>11}", 11), ("disk", "{:>6}", 6), ("host_loads", "{:>10}", 10),
           ("slot_loads", "{:>10}", 10), ("busy", "{:>6.3f}", 6), ("replica_h", "{:>9.2f}", 9)]


def table(summaries: list[dict], columns: list[tuple[str, str, int]] = COLUMNS) -> str:
    """Rows of `columns` (name, format, width) from summary dicts; a missing value prints as "-"."""
    head = " ".join(f"{name:>{w}}" if i else f"{name:<{w}}" for i, (name, _, w) in enumerate(columns))
    lines = [head]
    for s in summaries:
        lines.append(" ".join(fmt.format(s[name]) if s.get(name) is not None else f"{'-':>{w}}"
                             for name, fmt, w in columns))
    return "\n".join(lines)
