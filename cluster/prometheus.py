"""Prometheus text format, by hand: samples, histograms, and the families' HELP / TYPE lines.

The app's /metrics gathers numbers from other processes (the replicas' snapshots, the adapter tier's
counters), which prometheus_client's registries, one per process, do not hold; these few helpers write
their text the same way.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

Sample = tuple[str, dict[str, str], float]  # (metric name, labels, value)

SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TOKEN_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


@dataclass
class Histogram:
    """Cumulative counts over fixed upper bounds, as Prometheus keeps them."""

    bounds: Sequence[float] = SECONDS_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.bounds, value)
        for j in range(i, len(self.bounds)):
            self.counts[j] += 1
        self.total += value
        self.count += 1

    def samples(self, name: str, labels: dict[str, str] | None = None) -> list[Sample]:
        labels = labels or {}
        out = [(f"{name}_bucket", {**labels, "le": _number(b)}, float(c)) for b, c in zip(self.bounds, self.counts)]
        out.append((f"{name}_bucket", {**labels, "le": "+Inf"}, float(self.count)))
        out += [(f"{name}_sum", labels, self.total), (f"{name}_count", labels, float(self.count))]
        return out


def _number(value: float) -> str:
    return "+Inf" if math.isinf(value) else repr(float(value))


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    escaped = (str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for v in labels.values())
    return "{" + ",".join(f'{k}="{v}"' for k, v in zip(labels, escaped)) + "}"


def _family(sample_name: str, families: dict[str, tuple[str, str]]) -> str:
    for suffix in ("_bucket", "_sum", "_count"):
        base = sample_name.removesuffix(suffix)
        if base != sample_name and families.get(base, ("",))[0] == "histogram":
            return base
    return sample_name


def text(samples: Sequence[Sample], families: dict[str, tuple[str, str]]) -> str:
    """samples as Prometheus text, grouped by family; families: name -> (type, help)."""
    grouped: dict[str, list[str]] = {}
    for name, labels, value in samples:
        grouped.setdefault(_family(name, families), []).append(f"{name}{_labels(labels)} {_number(value)}")
    out = []
    for family, lines in grouped.items():
        kind, help_text = families.get(family, ("untyped", ""))
        out += [f"# HELP {family} {help_text}", f"# TYPE {family} {kind}", *lines]
    return "\n".join(out) + ("\n" if out else "")
