"""Operators' metrics of the engine replicas, on the app's own /metrics: what each replica reports, and the text.

A replica's metrics live in its own process, and the app's /metrics is answered by an ingress: each replica
sends a snapshot of its samples with its routing stats (every routing-stats period) to one named actor, the
MetricsBoard, and the ingress renders the board's latest snapshots with a `replica` label. One scrape target
gives every replica, and a replica that is gone drops out after REPORT_TTL_S.

Samples are Prometheus-shaped already: (name, labels, value), histograms as their _bucket / _sum / _count
samples, so rendering is grouping. Plain Python: the actor shell is at the end and imports Ray only there.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from cluster.prometheus import TOKEN_SECONDS_BUCKETS, Histogram, Sample, text

REPORT_TTL_S = 30.0

# name -> (type, help): every family a snapshot may hold, so each gets its HELP and TYPE lines.
FAMILIES: dict[str, tuple[str, str]] = {
    "lorafleet_lora_slots_used": ("gauge", "GPU adapter slots holding an adapter"),
    "lorafleet_lora_slots_free": ("gauge", "GPU adapter slots free"),
    "lorafleet_lora_gpu_memory_bytes": ("gauge", "GPU memory of the adapter slots (state: reserved, used)"),
    "lorafleet_lora_host_memory_bytes": ("gauge", "Host memory of the adapters held in the host cache"),
    "lorafleet_adapter_load_seconds": ("histogram", "Seconds to bring an adapter from the cluster tier into the "
                                                    "engine"),
    "lorafleet_adapter_unload_seconds": ("histogram", "Seconds to drop an adapter from the engine"),
    "lorafleet_adapter_load_failures_total": ("counter", "Adapter loads into the engine that failed, by reason"),
    "lorafleet_adapter_requests_total": ("counter", "Adapter requests by the tier that held the adapter (gpu, "
                                                    "host: resident here; object_store: loaded from the tier)"),
    "lorafleet_replica_time_to_first_token_seconds": ("histogram", "Time to first token at the replica, by "
                                                                   "adapter rank (0: the base model)"),
    "lorafleet_replica_time_per_output_token_seconds": ("histogram", "Time per output token after the first, "
                                                                     "by adapter rank"),
    "lorafleet_replica_queue_depth": ("gauge", "Requests in the replica (running and waiting)"),
    "lorafleet_engine_requests": ("gauge", "Engine requests by state (running, waiting)"),
    "lorafleet_lora_merged": ("gauge", "1 while an adapter runs merged into the base weights"),
    "lorafleet_lora_merges_total": ("counter", "Adapters merged into the base weights (replicas/lora_merge.py)"),
    "lorafleet_lora_load_worker_restarts_total": ("counter", "Adapter load worker processes that died and were "
                                                             "replaced"),
}


def render(reports: dict[str, Iterable[Sample]]) -> str:
    """Prometheus text of every replica's samples, each labelled with its replica."""
    return text([(name, {"replica": replica, **labels}, value)
                 for replica, samples in sorted(reports.items()) for name, labels, value in samples], FAMILIES)


LOAD_FAILURE_REASONS = ("invalid_adapter", "not_found", "source_unavailable", "capacity", "other")


def load_failure_reason(exc: BaseException) -> str:
    """The `reason` label of a failed adapter load."""
    from cluster.errors import AdapterNotFoundError, SourceUnavailableError
    from lora_core.errors import InvalidAdapterError, LoRACapacityError

    for types, reason in (((InvalidAdapterError,), "invalid_adapter"), ((AdapterNotFoundError,), "not_found"),
                          ((SourceUnavailableError,), "source_unavailable"), ((LoRACapacityError,), "capacity")):
        if isinstance(exc, types):
            return reason
    return "other"


class ReplicaMetrics:
    """One replica's counters and histograms (LoRAServer feeds them) and its snapshot."""

    def __init__(self) -> None:
        self.load_seconds = Histogram()
        self.unload_seconds = Histogram()
        # Every reason from the start at 0, as Prometheus advises for label values known up front: a rate over a
        # series that appears with its first failure misses that failure.
        self.load_failures: dict[str, int] = dict.fromkeys(LOAD_FAILURE_REASONS, 0)
        self.ttft: dict[int, Histogram] = {}  # by adapter rank, 0 for the base model
        self.tpot: dict[int, Histogram] = {}

    def load_failed(self, exc: BaseException) -> None:
        self.load_failures[load_failure_reason(exc)] += 1

    def request_done(self, rank: int, ttft_s: float | None, tpot_s: float | None) -> None:
        if ttft_s is not None:
            self.ttft.setdefault(rank, Histogram()).observe(ttft_s)
        if tpot_s is not None:
            self.tpot.setdefault(rank, Histogram(TOKEN_SECONDS_BUCKETS)).observe(tpot_s)

    def samples(self, stats: dict[str, Any], memory: dict[str, int], adapter_events: dict[str, int],
                engine: dict[str, int]) -> list[Sample]:
        """stats: LoRAServer.routing_stats(); memory: LoRAModelManager.memory_bytes(); engine: requests by state."""
        out: list[Sample] = [
            ("lorafleet_lora_slots_used", {}, float(len(stats["gpu_adapters"]))),
            ("lorafleet_lora_slots_free", {}, float(stats["free_slots"])),
            ("lorafleet_replica_queue_depth", {}, float(stats["queue_len"])),
            ("lorafleet_lora_host_memory_bytes", {}, float(memory.get("host", 0))),
            ("lorafleet_lora_merged", {}, float(stats.get("merged_adapter") is not None)),
            ("lorafleet_lora_merges_total", {}, float(stats.get("lora_merges", 0))),
            ("lorafleet_lora_load_worker_restarts_total", {}, float(stats.get("load_worker_restarts", 0))),
        ]
        out += [("lorafleet_lora_gpu_memory_bytes", {"state": state}, float(memory.get(f"gpu_{state}", 0)))
                for state in ("reserved", "used")]
        out += [("lorafleet_engine_requests", {"state": k}, float(v)) for k, v in sorted(engine.items())]
        out += [("lorafleet_adapter_requests_total", {"tier": k}, float(v)) for k, v in sorted(adapter_events.items())]
        out += [("lorafleet_adapter_load_failures_total", {"reason": k}, float(v))
                for k, v in sorted(self.load_failures.items())]
        out += self.load_seconds.samples("lorafleet_adapter_load_seconds")
        out += self.unload_seconds.samples("lorafleet_adapter_unload_seconds")
        for rank, h in sorted(self.ttft.items()):
            out += h.samples("lorafleet_replica_time_to_first_token_seconds", {"rank": str(rank)})
        for rank, h in sorted(self.tpot.items()):
            out += h.samples("lorafleet_replica_time_per_output_token_seconds", {"rank": str(rank)})
        return out


class RequestTiming:
    """One request's time to first token and per output token after it, into ReplicaMetrics when it is done."""

    def __init__(self, metrics: ReplicaMetrics, rank: int, clock=time.monotonic) -> None:
        self.metrics, self.rank, self._clock = metrics, rank, clock
        self.start, self.first, self.tokens = clock(), None, 0

    def output(self, out: Any) -> None:
        """A cumulative RequestOutput of the request."""
        self.tokens = max((len(c.token_ids) for c in out.outputs), default=0)
        if self.first is None and self.tokens:
            self.first = self._clock()

    def done(self) -> None:
        if self.first is None:
            return
        tpot = (self._clock() - self.first) / (self.tokens - 1) if self.tokens > 1 else None
        self.metrics.request_done(self.rank, self.first - self.start, tpot)


class MetricsBoardState:
    """The latest snapshot of each replica; those older than REPORT_TTL_S are gone replicas."""

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._reports: dict[str, tuple[float, list[Sample]]] = {}

    def report(self, replica: str, samples: list[Sample]) -> None:
        self._reports[replica] = (self._clock(), samples)

    def live(self) -> dict[str, list[Sample]]:
        now = self._clock()
        self._reports = {r: (t, s) for r, (t, s) in self._reports.items() if now - t <= REPORT_TTL_S}
        return {r: s for r, (_, s) in self._reports.items()}


BOARD_NAME = "lorafleet-metrics-board"


def get_or_create_metrics_board() -> Any:
    """The cluster's MetricsBoard actor (detached: it outlives whichever replica made it)."""
    import ray

    @ray.remote(num_cpus=0)
    class MetricsBoard(MetricsBoardState):
        pass

    return MetricsBoard.options(name=BOARD_NAME, get_if_exists=True, lifetime="detached",
                                max_restarts=-1).remote()
