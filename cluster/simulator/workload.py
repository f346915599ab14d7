"""Workloads: seeded request generators and CSV traces (arrival_s, adapter, prompt_tokens, output_tokens).

A generated workload is a list of Request, sorted by arrival; `write_trace`
writes it out and `read_trace` replays a user's own trace as is. Popularity is
Zipf(s) over the adapters, optionally with tenant bursts (a run of requests for
one adapter) and churn (every `churn_every_s` a new adapter becomes the most
popular). Arrivals are Poisson or Gamma (cv > 1: bursty), their rate scaled by
an optional diurnal curve; prompt and output lengths are lognormal (long tail),
clipped to the engine's limits.
"""

from __future__ import annotations

import bisect
import csv
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

BASE = ""  # the adapter column of a base-model request


@dataclass(frozen=True)
class Request:
    arrival_s: float
    adapter: str | None  # None: the base model
    prompt_tokens: int
    output_tokens: int
    rank: int = 16


@dataclass
class WorkloadConfig:
    duration_s: float = 60.0
    rate: float = 20.0  # mean requests per second
    num_adapters: int = 1000
    zipf_s: float = 1.0
    arrival: str = "poisson"  # or "gamma"
    gamma_cv: float = 2.0  # coefficient of variation of inter-arrival times (gamma)
    diurnal_amplitude: float = 0.0  # rate x (1 + a sin(2 pi t / period))
    diurnal_period_s: float = 86400.0
    burst_prob: float = 0.0  # chance an arrival starts a tenant burst
    burst_len: int = 8  # requests in a burst, same adapter, arriving together
    burst_spacing_s: float = 0.05
    churn_every_s: float = 0.0  # 0: no churn
    base_share: float = 0.0  # share of base-model requests
    prompt_median: int = 256
    prompt_sigma: float = 1.0
    output_median: int = 128
    output_sigma: float = 1.0
    max_prompt: int = 4096
    max_output: int = 1024
    ranks: tuple[int, ...] = (16,)  # adapter i's rank is ranks[i % len(ranks)]
    seed: int = 0


def adapter_name(i: int) -> str:
    return f"a{i:06d}"


@dataclass
class _Zipf:
    """Inverse-CDF sampling of ranks 0..n-1 with P(k) ~ 1/(k+1)^s."""

    n: int
    s: float
    cdf: list[float] = field(init=False)

    def __post_init__(self) -> None:
        acc, cdf = 0.0, []
        for k in range(self.n):
            acc += 1.0 / (k + 1) ** self.s
            cdf.append(acc)
        self.cdf = [c / acc for c in cdf]

    def sample(self, rng: random.Random) -> int:
        return min(bisect.bisect_left(self.cdf, rng.random()), self.n - 1)


def generate(cfg: WorkloadConfig) -> list[Request]:
    rng = random.Random(cfg.seed)
    zipf = _Zipf(cfg.num_adapters, cfg.zipf_s)
    # Popularity rank -> adapter id: a seeded permutation, rotated by churn so a new adapter becomes hottest.
    order = list(range(cfg.num_adapters))
    rng.shuffle(order)
    out: list[Request] = []
    t = 0.0
    while True:
        rate = cfg.rate * max(1e-6, 1.0 + cfg.diurnal_amplitude * math.sin(2 * math.pi * t / cfg.diurnal_period_s))
        if cfg.arrival == "gamma":
            k = 1.0 / cfg.gamma_cv ** 2  # shape; mean 1/rate
            t += rng.gammavariate(k, 1.0 / (k * rate))
        elif cfg.arrival == "poisson":
            t += rng.expovariate(rate)
        else:
            raise ValueError(f"unknown arrival process {cfg.arrival!r} (poisson, gamma)")
        if t >= cfg.duration_s:
            break
        epoch = int(t // cfg.churn_every_s) if cfg.churn_every_s > 0 else 0
        if rng.random() < cfg.base_share:
            idx = None
        else:
            # Churn: epoch e's hottest adapter is the one ranked e-th coldest at the start (a new one each epoch).
            k = zipf.sample(rng)
            idx = order[(k - epoch) % cfg.num_adapters] if epoch else order[k]
        n = cfg.burst_len if idx is not None and rng.random() < cfg.burst_prob else 1
        for j in range(n):
            out.append(_request(cfg, rng, t + j * cfg.burst_spacing_s, idx))
    out.sort(key=lambda r: r.arrival_s)
    return out


def _request(cfg: WorkloadConfig, rng: random.Random, t: float, idx: int | None) -> Request:
    prompt = int(min(cfg.max_prompt, max(1, round(rng.lognormvariate(math.log(cfg.prompt_median), cfg.prompt_sigma)))))
    output = int(min(cfg.max_output, max(1, round(rng.lognormvariate(math.log(cfg.output_median), cfg.output_sigma)))))
    if idx is None:
        return Request(t, None, prompt, output, 0)
    return Request(t, adapter_name(idx), prompt, output, cfg.ranks[idx % len(cfg.ranks)])


FIELDS = ("arrival_s", "adapter", "prompt_tokens", "output_tokens", "rank")


def write_trace(requests: list[Request], path: str | Path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(FIELDS)
        for r in requests:
            w.writerow((f"{r.arrival_s:.6f}", r.adapter or BASE, r.prompt_tokens, r.output_tokens, r.rank))


def read_trace(path: str | Path, default_rank: int = 16) -> list[Request]:
    """A CSV with a header naming at least arrival_s, adapter, prompt_tokens, output_tokens (rank optional);
    an empty adapter is a base-model request. Rows are replayed as given, sorted by arrival."""
    out = []
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = set(FIELDS[:4]) - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"trace {path} lacks the columns {sorted(missing)}")
        for line, row in enumerate(reader, start=2):
            try:
                adapter = row["adapter"].strip() or None
                rank = int(row.get("rank") or default_rank) if adapter else 0
                out.append(Request(float(row["arrival_s"]), adapter, max(1, int(row["prompt_tokens"])),
                                   max(1, int(row["output_tokens"])), rank))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"trace {path} line {line}: {exc}") from None
    out.sort(key=lambda r: r.arrival_s)
    return out
