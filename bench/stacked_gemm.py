"""The stacked GEMM's time against its extra rows: does cuBLAS's pick for [W ; A rows] cost more than the rows?

A stacked step's GEMM reads `out + bound x slices x rank` rows (lora_core/stacked_a.py). The extra rows are
a few percent of the bytes, yet the 8B decode profile (RESULTS.md, ninth session) showed each site's GEMM
several microseconds slower with one adapter's 16-48 rows: cuBLAS picks another kernel for the odd row
count. This sweeps the extra rows E for the Llama-3-8B sites and prints, for each, the time over the base
GEMM and the best time over E' in [E, E + pad] (zero rows read for nothing but a better kernel).

    python bench/stacked_gemm.py                       # M = 32 rows, E in steps of 16 up to 1664
    python bench/stacked_gemm.py --tokens 16 64 --step 64
    python bench/stacked_gemm.py --in-situ        # 32 layers' GEMMs in one graph, one site's rows varied

--in-situ times what an engine step sees: every layer's four GEMMs back to back in one CUDA graph (16 GB of
weights streamed, so nothing stays in L2 and no flush is needed), one site's extra rows varied at a time
from its slot bound's exact count up to --pad more, the other sites at their exact counts.

What came of it (RESULTS.md, ninth session): in situ, padding won back ~100 of the 228 us that one adapter's
rows cost a 32-row step, but the same choices made by a warm-up tuner gained nothing in the engine's decode
steps (and cost 20 s of warm-up): tried and reverted.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.punica_kernels import graph_of, time_graph  # noqa: E402

SITES = {"qkv": (4096, 6144, 3), "o": (4096, 4096, 1), "gate_up": (4096, 28672, 2), "down": (14336, 4096, 1)}
BOUNDS = (1, 4, 16, 32)


def sweep(site: str, tokens: int, extras: list[int]) -> dict[int, float]:
    hidden, out, _ = SITES[site]
    w = torch.randn(out + max(extras), hidden, device="cuda", dtype=torch.bfloat16) / hidden ** 0.5
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    times = {}
    for extra in extras:
        rows = w[:out + extra]
        times[extra] = time_graph(graph_of(lambda rows=rows: torch.nn.functional.linear(x, rows)))
    return times


def in_situ(tokens: int, rank: int, pad: int, step: int, layers: int) -> None:
    slots = max(BOUNDS)
    weights = {site: [torch.randn(out + slots * slices * rank + pad, hidden, device="cuda", dtype=torch.bfloat16)
                      / hidden ** 0.5 for _ in range(layers)] for site, (hidden, out, slices) in SITES.items()}
    xs = {hidden: torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16) for hidden, _, _ in SITES.values()}

    def step_us(rows: dict[str, int]) -> float:
        def run():
            for i in range(layers):
                for site, (hidden, _, _) in SITES.items():
                    torch.nn.functional.linear(xs[hidden], weights[site][i][:rows[site]])
        graph = graph_of(run)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(12):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(1e3 * start.elapsed_time(end))
        return sorted(times)[len(times) // 2]

    base = step_us({site: out for site, (_, out, _) in SITES.items()})
    print(f"in situ: {layers} layers x 4 GEMMs, T={tokens}, rank {rank}: no extra rows {base:.1f} us per step")
    for bound in BOUNDS:
        exact = {site: out + bound * slices * rank for site, (_, out, slices) in SITES.items()}
        at_exact = step_us(exact)
        line = [f"bound {bound:2}: exact rows {at_exact - base:+7.1f} us/step;"]
        for site in SITES:
            times = {extra: step_us(exact | {site: exact[site] + extra}) for extra in range(0, pad + 1, step)}
            best = min(times, key=times.get)
            line.append(f"{site} +{best} rows {times[best] - times[0]:+.1f}")
        print("  ".join(line))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[32])
    p.add_argument("--step", type=int, default=16)
    p.add_argument("--max-extra", type=int, default=1664)
    p.add_argument("--pad", type=int, default=256, help="zero rows a padded GEMM may add")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    p.add_argument("--in-situ", action="store_true")
    p.add_argument("--layers", type=int, default=32)
    a = p.parse_args()
    if a.in_situ:
        for tokens in a.tokens:
            in_situ(tokens, a.rank, a.pad, a.step, a.layers)
        return
    extras = list(range(0, a.max_extra + a.pad + 1, a.step))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "stacked_gemm.csv"), "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["site", "tokens", "extra_rows", "us"])
        for tokens in a.tokens:
            for site, (_, _, slices) in SITES.items():
                exact = {bound * slices * a.rank for bound in BOUNDS}
                times = sweep(site, tokens, sorted(set(extras) | exact))
                for extra, us in times.items():
                    out.writerow([site, tokens, extra, f"{us:.3f}"])
                base = times[0]
                print(f"{site:8} T={tokens:3}  base {base:7.2f} us   rank {a.rank}, extra us at slot bound: "
                      "exact -> best padded (rows)")
                for bound in BOUNDS:
                    extra = bound * slices * a.rank
                    if extra > a.max_extra:
                        continue
                    padded = min((e for e in times if extra <= e <= extra + a.pad), key=times.get)
                    print(f"    bound {bound:2}  rows {extra:5}  {times[extra] - base:6.2f} -> "
                          f"{times[padded] - base:6.2f} ({padded})")
                row = "  ".join(f"{e}:{us - base:.1f}" for e, us in times.items())
                print(f"    all: {row}")


if __name__ == "__main__":
    main()
