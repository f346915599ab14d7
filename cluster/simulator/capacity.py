"""The request rate a cluster can sustain on a workload: the load axis of the benchmarks ("70% of capacity").

A replica at capacity runs full batches: as many sequences decoding as it can run at
once, their prompts joining as others finish. A request then costs its share of the
decode steps (output tokens x step time / batch) plus its prompt's step time, and
capacity is the replicas over the mean cost, on the workload's own length and adapter
distribution (a sample of it), with the step model of the GPU.

"As many as it can run at once" is `max_num_seqs`, unless the GPU slots bind first: a
step holds at most `max_loras` distinct adapters, so a replica whose requests spread
over many adapters runs smaller batches. The batch is the largest whose expected
distinct adapters fit the slots, on a replica's share of the traffic: an adapter with
at least 1/replicas of the requests is served everywhere (its share is the same on
every replica), a rarer one on one replica (its requests all go there), as
adapter-affinity routing places them. It is an estimate of saturation, not a bound.
"""

from __future__ import annotations

import random
from collections import Counter

from cluster.simulator.calibration import StepModel
from cluster.simulator.replica import ReplicaConfig
from cluster.simulator.workload import Request, WorkloadConfig, generate


def expected_distinct(shares: list[float], replicas: int, batch: int) -> float:
    """Expected distinct adapters among `batch` requests of one replica, for adapters with these shares of the
    cluster's requests (the rest base-model), placed as the module docstring says."""
    out = 0.0
    for p in shares:
        if p * replicas >= 1.0:
            out += 1.0 - (1.0 - p) ** batch
        else:
            out += (1.0 - (1.0 - p * replicas) ** batch) / replicas
    return out


def slot_limited_batch(cfg: ReplicaConfig, replicas: int, sample: list[Request]) -> tuple[int, float]:
    """The largest batch (<= max_num_seqs) whose expected distinct adapters fit max_loras, and that count."""
    counts = Counter(r.adapter for r in sample if r.adapter is not None)
    shares = [c / len(sample) for c in counts.values()]
    batch, distinct = 1, expected_distinct(shares, replicas, 1)
    for b in range(2, cfg.max_num_seqs + 1):
        d = expected_distinct(shares, replicas, b)
        if d > cfg.max_loras:
            break
        batch, distinct = b, d
    return batch, distinct


def request_cost_s(req: Request, model: StepModel, cfg: ReplicaConfig, batch: int | None = None,
                   adapters: float | None = None) -> float:
    """Replica-seconds one request takes in steps of `batch` sequences (default max_num_seqs) over `adapters`
    distinct adapters (default as many as the slots hold)."""
    batch = batch or cfg.max_num_seqs
    n = min(cfg.max_loras, batch) if adapters is None else adapters
    n = n if req.adapter is not None else 0
    rank = req.rank if req.adapter is not None else 0
    step = model.step_s(batch, 0, round(n), rank)
    decode = step / batch * max(req.output_tokens - 1, 0)
    prompt = model.step_s(0, req.prompt_tokens, 0, 0) - model.step_s(0, 0, 0, 0)
    return decode + prompt + step / batch


def capacity_rps(replicas: int, model: StepModel, cfg: ReplicaConfig, sample: list[Request]) -> float:
    """Requests per second `replicas` replicas sustain on requests like `sample`'s."""
    if not sample:
        raise ValueError("capacity needs a sample of requests")
    batch, distinct = slot_limited_batch(cfg, replicas, sample)
    mean = sum(request_cost_s(r, model, cfg, batch, max(1.0, distinct)) for r in sample) / len(sample)
    return replicas / mean


def workload_capacity_rps(replicas: int, model: StepModel, cfg: ReplicaConfig, workload: WorkloadConfig,
                          n: int = 20000) -> float:
    """capacity_rps on a sample of `n` requests drawn from `workload`'s length, rank and adapter distributions."""
    probe = WorkloadConfig(**{**workload.__dict__, "duration_s": n / 100.0, "rate": 100.0, "diurnal_amplitude": 0.0,
                              "burst_prob": 0.0, "arrival": "poisson", "seed": random.Random(workload.seed).randrange(1 << 30)})
    return capacity_rps(replicas, model, cfg, generate(probe))
