"""The replica model's step time, calibrated from bench/engine.py's GPU rows in bench/RESULTS.md.

step_ms = t0 + a * decode_seqs + b * prompt_tokens
          + [n > 1] * (f0 + f1 * rank) + g * n * rank
n: distinct adapters in the step, rank: the largest of their ranks. One
adapter alone costs nothing extra because the engine merges it into the base
weights (RESULTS: one-r16 0.02-0.03 ms over base). Every coefficient is kept
>= 0, so a step never gets cheaper by adding work: the bound relies on that.

Sources: `python bench/engine.py` on the lent GPUs (8B shape, bfloat16, closed loop of 32, max_loras 32,
prompts and outputs uniform in 8..512 tokens), its figures copied into ROWS below so that the fit needs no log:
  H200: decode ms per scenario, and base decode at batch 32 and 64 with async scheduling (the per-sequence
        slope a);
  H100: decode ms per scenario (base 7.29 ms, 3,183 tok/s).
The #ad of an H100 row is the H200 row's for the same scenario (the workload
is the same; the H100 table does not print it). The prompt cost b is what the
base rows' tok/s leaves after their decode steps (an effective figure: it
also carries the closed loop's ramps).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# (scenario, n distinct adapters, rank, decode step ms at batch 32); n 0 = base.
ROWS: dict[str, list[tuple[str, float, int, float]]] = {
    "h200-llama3-8b": [
        ("base", 0, 0, 5.47), ("uniform100-r16", 27.5, 16, 6.19), ("uniform1000-r16", 31.4, 16, 6.23),
        ("uniform100-r64", 27.8, 64, 8.44), ("zipf100-r64", 10.6, 64, 7.29),
        ("base", 0, 0, 5.54), ("one-r16", 1, 16, 5.57), ("uniform1000-r16", 31.4, 16, 6.36),
        ("zipf1000-r16", 11.8, 16, 6.22), ("uniform1000-r64", 31.4, 64, 8.67), ("zipf1000-r64", 11.9, 64, 7.32),
        ("base", 0, 0, 5.64), ("one-r16", 1, 16, 5.66), ("distinct-r16", 32, 16, 6.56),
        ("uniform100-r16", 27.5, 16, 6.54), ("zipf100-r16", 10.7, 16, 6.47), ("uniform100-r64", 27.8, 64, 9.21),
        ("zipf100-r64", 10.6, 64, 8.02),
    ],
    "h100-llama3-8b": [
        ("base", 0, 0, 7.29), ("zipf100-r64", 10.6, 64, 9.48), ("uniform100-r16", 27.5, 16, 8.27),
        ("zipf100-r16", 10.7, 16, 8.33),
    ],
}
# Base decode at batch 32 and 64 in one run (H200): 5.75 and 6.15 ms.
SLOPE_MS_PER_SEQ = {"h200-llama3-8b": (6.15 - 5.75) / 32, "h100-llama3-8b": (6.15 - 5.75) / 32 * 7.29 / 5.54}
# Base rows' tok/s with their decode step (tok/s, dec ms), for the prompt cost.
BASE_THROUGHPUT = {"h200-llama3-8b": (4085.9, 5.47), "h100-llama3-8b": (3183.0, 7.29)}
ENGINE_BENCH = dict(requests=128, concurrency=32, mean_prompt=260.0, mean_output=260.0)
# bytes of one adapter per rank unit: ~84 MB for a rank-16 Llama-3-8B adapter on all 7 projections (design.md)
ADAPTER_BYTES_PER_RANK = {"h200-llama3-8b": 84e6 / 16, "h100-llama3-8b": 84e6 / 16}


@dataclass(frozen=True)
class StepModel:
    """Step time of one engine step (seconds), from the fit's coefficients (milliseconds)."""

    name: str
    t0: float
    a: float
    b: float
    f0: float
    f1: float
    g: float
    rms_ms: float = 0.0
    max_err_ms: float = 0.0

    def step_s(self, decode_seqs: int, prompt_tokens: int, n_adapters: int, max_rank: int) -> float:
        ms = self.t0 + self.a * decode_seqs + self.b * prompt_tokens + self.g * n_adapters * max_rank
        if n_adapters > 1:
            ms += self.f0 + self.f1 * max_rank
        return ms * 1e-3

    def adapter_bytes(self, rank: int) -> float:
        return ADAPTER_BYTES_PER_RANK[self.name] * rank


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: drop the most negative one and refit until none is."""
    active = list(range(x.shape[1]))
    while True:
        coef = np.zeros(x.shape[1])
        coef[active] = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
        neg = [i for i in active if coef[i] < 0]
        if not neg:
            return coef
        active.remove(min(neg, key=lambda i: coef[i]))


def fit(name: str) -> tuple[StepModel, list[tuple[str, float, float]]]:
    """Fit the step model for one GPU and model shape; returns it and (scenario, measured, fitted) per row."""
    rows = ROWS[name]
    a = SLOPE_MS_PER_SEQ[name]
    x = np.array([[1.0, float(n > 1), rank * float(n > 1), n * rank] for _, n, rank, _ in rows])
    y = np.array([ms - a * 32 for *_, ms in rows])
    t0, f0, f1, g = _nnls(x, y)
    tokps, dec_ms = BASE_THROUGHPUT[name]
    bench = ENGINE_BENCH
    out_tokens = bench["requests"] * bench["mean_output"]
    decode_s = out_tokens / bench["concurrency"] * dec_ms * 1e-3
    b = max(0.0, (out_tokens / tokps - decode_s) / (bench["requests"] * bench["mean_prompt"]) * 1e3)
    pred = x @ np.array([t0, f0, f1, g]) + a * 32
    err = pred - np.array([ms for *_, ms in rows])
    model = StepModel(name, float(t0), a, float(b), float(f0), float(f1), float(g),
                      float(np.sqrt(np.mean(err ** 2))), float(np.max(np.abs(err))))
    return model, [(scn, ms, float(p)) for (scn, _, _, ms), p in zip(rows, pred)]


def fit_table(name: str) -> str:
    """The fit's rows and error, as printed by bench/simulate.py."""
    model, rows = fit(name)
    lines = [f"step model {name}: t0 {model.t0:.3f} ms + {model.a * 1e3:.1f} us/seq + {model.b * 1e3:.1f} us/prompt "
             f"token + [n>1]({model.f0:.3f} + {model.f1 * 1e3:.2f} us x rank) + {model.g * 1e3:.3f} us x n x rank",
             f"{'scenario':<18}{'dec ms':>8}{'fit ms':>8}{'err %':>8}"]
    lines += [f"{scn:<18}{ms:>8.2f}{p:>8.2f}{(p - ms) / ms * 100:>8.1f}" for scn, ms, p in rows]
    lines.append(f"rms error {model.rms_ms:.3f} ms, max {model.max_err_ms:.3f} ms over {len(rows)} rows")
    return "\n".join(lines)


@dataclass(frozen=True)
class TierCosts:
    """Seconds to move an adapter of `nbytes` into a replica, per tier (bandwidths in bytes/s).

    Defaults: slot write (host image -> GPU slot) at 50 GB/s (RESULTS: "25 rank-64 copies would be ~0.17 s at
    50 GB/s"); a load from bytes on the node into the host tier (read + prepare into a pinned pool block) from the
    H100 row of the pinned-pool section: 69.6 ms rank 16, 191.7 ms rank 64 -> 28.8 ms + bytes / 2.06 GB/s. The
    network between nodes and the origin are not measured here: set them for your cluster.
    """

    slot_write_bw: float = 50e9
    host_load_latency_s: float = 0.0288
    host_load_bw: float = 2.06e9
    network_bw: float = 12.5e9  # object store, other node (100 Gb/s)
    origin_latency_s: float = 0.2
    origin_bw: float = 1e9

    def slot_write_s(self, nbytes: float) -> float:
        return nbytes / self.slot_write_bw

    def local_load_s(self, nbytes: float) -> float:
        """Object store on the same node, or node-local disk: read and prepare into the host tier."""
        return self.host_load_latency_s + nbytes / self.host_load_bw

    def remote_read_s(self, nbytes: float) -> float:
        return nbytes / self.network_bw

    def origin_s(self, nbytes: float) -> float:
        return self.origin_latency_s + nbytes / self.origin_bw
