"""A decode step's LoRA beside the base GEMMs (a second stream) vs after them (the stacked path), in situ (GPU).

Each LoRA site of a layer is a base GEMM plus a shrink and an expand. The stacked path (docs/lora_core.md)
puts the shrink into the base GEMM and runs the expand after it, on the critical path. The shrink and
expand need only the layer's input, so they can run on a second stream while the base GEMM streams its
weight, into a delta that the op after the layer adds. For L layers x 4 Llama-3-8B sites at M rows, each
variant is one CUDA graph of the whole stack (replays timed with L2 flushed):
  base      the base GEMMs
  stacked   stacked GEMM, then add_expand_stacked
  parallel  fork: [zero delta, shrink, expand into delta] on a side stream beside the base GEMM; join; y += delta
  p-noadd   the same without the add (what it costs once the next op reads the delta itself)

    python bench/parallel_lora.py [--rows 32] [--layers 32] [--pops one zipf distinct]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.punica_kernels import graph_of, time_graph  # noqa: E402
from bench.lora_site import SITES, SLOTS  # noqa: E402
from lora_core.mapping import LoRAMapping  # noqa: E402
from lora_core.punica import PunicaWrapper  # noqa: E402
from lora_core.stacked_a import a_rows, stack_weight  # noqa: E402
from tests.lora_core.punica_cases import stacked_weights  # noqa: E402


def step_slots(pop: str, rows: int, g: torch.Generator) -> list[int]:
    """one adapter; ~10 adapters with Zipf-like shares (in the lowest slots, as compaction keeps them); distinct."""
    if pop == "one":
        return [0] * rows
    if pop == "distinct":
        return list(range(rows))
    weights = torch.tensor([1 / (i + 1) ** 1.5 for i in range(100)])
    drawn = torch.multinomial(weights, rows, replacement=True, generator=g).tolist()
    order = {s: i for i, s in enumerate(sorted(set(drawn)))}
    return [order[s] for s in drawn]


class Site:
    def __init__(self, name: str, rank: int, g: torch.Generator) -> None:
        self.k, self.slices = SITES[name]
        self.n = sum(self.slices)
        self.a, self.b, self.ranks = stacked_weights(SLOTS, rank, self.k, self.slices, [rank], torch.bfloat16,
                                                     "cuda", g)
        w = torch.randn(self.n, self.k, device="cuda", dtype=torch.bfloat16) / self.k ** 0.5
        self.stacked = stack_weight(w, SLOTS, len(self.slices), rank)
        del w
        a_rows(self.stacked, self.n, SLOTS, len(self.slices), rank).copy_(self.a.transpose(0, 1))
        self.w = self.stacked[:self.n]


def run(pop: str, rows: int, layers: int, rank: int, g: torch.Generator) -> dict[str, float]:
    slots = step_slots(pop, rows, g)
    ids = list(range(1, SLOTS + 1))
    mapping = LoRAMapping([ids[s] for s in slots], [ids[slots[0]]], False)
    stacked_p = PunicaWrapper(max(rows, 16), SLOTS, "cuda", backend="triton", stacked_max_tokens=rows)
    side_p = PunicaWrapper(max(rows, 16), SLOTS, "cuda", backend="triton", use_pdl=False)
    for p in (stacked_p, side_p):
        p.update_metadata(mapping, ids)
    bound = stacked_p.stacked_rows()
    sites = [{name: Site(name, rank, g) for name in SITES} for _ in range(layers)]
    xs = {k: torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for k, _ in SITES.values()}
    deltas = {name: torch.empty(rows, sum(sl), device="cuda", dtype=torch.bfloat16) for name, (_, sl) in SITES.items()}
    side = torch.cuda.Stream()
    outs: dict[str, torch.Tensor] = {}

    def base():
        for layer in sites:
            for name, st in layer.items():
                outs[name] = F.linear(xs[st.k], st.w)

    def stacked():
        for layer in sites:
            for name, st in layer.items():
                out = F.linear(xs[st.k], st.stacked[:st.n + bound * len(st.slices) * rank])
                stacked_p.add_expand_stacked(out[:, :st.n], out[:, st.n:], st.b, st.slices, st.ranks)
                outs[name] = out[:, :st.n]

    def parallel(add: bool):
        def fn():
            for layer in sites:
                for name, st in layer.items():
                    main = torch.cuda.current_stream()
                    side.wait_stream(main)
                    with torch.cuda.stream(side):
                        d = deltas[name]
                        d.zero_()
                        side_p.add_lora_linear(d, xs[st.k], st.a, st.b, None, 1.0, st.slices, st.ranks)
                    y = F.linear(xs[st.k], st.w)
                    main.wait_stream(side)
                    if add:
                        y.add_(d)
                    outs[name] = y
        return fn

    times = {}
    results = {}
    for label, fn in (("base", base), ("stacked", stacked), ("parallel", parallel(True)),
                      ("p-noadd", parallel(False))):
        times[label] = time_graph(graph_of(fn))
        fn()
        torch.cuda.synchronize()
        results[label] = {k: v.float().clone() for k, v in outs.items()}
    err = max(((results["parallel"][k] - results["stacked"][k]).abs().max()
               / results["stacked"][k].abs().max()).item() for k in SITES)
    return times | {"adapters": len(set(slots)), "bound": bound, "err": err}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--pops", nargs="+", default=["one", "zipf", "distinct"])
    a = p.parse_args()
    g = torch.Generator().manual_seed(3)
    print(f"device {torch.cuda.get_device_name()}  {a.layers} layers x 4 sites, M={a.rows}, rank {a.rank}; us per step")
    print(f"{'pop':9} {'ad':>3} {'bnd':>3} {'base':>9} {'stacked':>9} {'parallel':>9} {'p-noadd':>9} "
          f"{'+stacked':>9} {'+parallel':>10} {'+p-noadd':>9} {'relerr':>8}")
    for pop in a.pops:
        r = run(pop, a.rows, a.layers, a.rank, g)
        b = r["base"]
        print(f"{pop:9} {r['adapters']:3} {r['bound']:3} {b:9.1f} {r['stacked']:9.1f} {r['parallel']:9.1f} "
              f"{r['p-noadd']:9.1f} {r['stacked'] - b:9.1f} {r['parallel'] - b:10.1f} {r['p-noadd'] - b:9.1f} "
              f"{r['err']:8.1e}", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
