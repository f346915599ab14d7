"""The request rate a cluster can sustain on a workload: the load axis of the benchmarks ("70% of capacity").

A replica at capacity runs full batches: `max_num_seqs` sequences decoding, their
prompts joining as others finish, and as many distinct adapters as the slots hold.
A request then costs its share of the decode steps (output tokens x step time / batch)
plus its prompt's step time. Capacity is the replicas over the mean cost, on the
workload's own length distribution (a sample of it), with the step model of the GPU.
It is an estimate of saturation, not a bound: it charges every step the most distinct
adapters, so a Zipf-heavy mix may run a little faster than it says.
"""

from __future__ import annotations

import random

from cluster.simulator.calibration import StepModel
from cluster.simulator.replica import ReplicaConfig
from cluster.simulator.workload import Request, WorkloadConfig, generate


def request_cost_s(req: Request, model: StepModel, cfg: ReplicaConfig) -> float:
    """Replica-seconds one request takes at full batch."""
    batch = cfg.max_num_seqs
    n = min(cfg.max_loras, batch) if req.adapter is not None else 0
    rank = req.rank if req.adapter is not None else 0
    decode = model.step_s(batch, 0, n, rank) / batch * max(req.output_tokens - 1, 0)
    prompt = model.step_s(0, req.prompt_tokens, 0, 0) - model.step_s(0, 0, 0, 0)
    return decode + prompt + model.step_s(batch, 0, n, rank) / batch


def capacity_rps(replicas: int, model: StepModel, cfg: ReplicaConfig, sample: list[Request]) -> float:
    """Requests per second `replicas` replicas sustain on requests like `sample`'s."""
    if not sample:
        raise ValueError("capacity needs a sample of requests")
    mean = sum(request_cost_s(r, model, cfg) for r in sample) / len(sample)
    return replicas / mean


def workload_capacity_rps(replicas: int, model: StepModel, cfg: ReplicaConfig, workload: WorkloadConfig,
                          n: int = 4000) -> float:
    """capacity_rps on a sample of `n` requests drawn from `workload`'s length and rank distributions."""
    probe = WorkloadConfig(**{**workload.__dict__, "duration_s": n / 100.0, "rate": 100.0, "diurnal_amplitude": 0.0,
                              "burst_prob": 0.0, "arrival": "poisson", "seed": random.Random(workload.seed).randrange(1 << 30)})
    return capacity_rps(replicas, model, cfg, generate(probe))
