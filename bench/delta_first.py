"""Prompt-sized LoRA sites: the expand's read-modify-write of y against a delta written under the GEMM (GPU).

For steps too large for the stacked path (prompts), a site used to run y = x @ W^T, then the SGMV shrink and
an expand that reads y back, adds and writes it. PunicaWrapper.lora_linear runs the expand first instead: it
writes the LoRA delta into a new y (zeros on rows with no adapter), and the base GEMM adds x @ W^T into it as
cuBLAS's C operand (y.addmm_(x, W^T), beta = 1). Per case this times CUDA graphs replayed with L2 flushed:
  base      y = x @ W^T
  addmm     y.addmm_(x, W^T) alone (what beta = 1 costs cuBLAS)
  rmw       base, then add_lora_linear (the expand reads y back)
  delta     lora_linear
and prints each LoRA's extra time over base and delta's over rmw's. Run it in another tree (git archive) to
compare kernels side by side in one device call.

    python bench/delta_first.py [--sites qkv o gate_up down] [--tokens 256 512 1024 2048] [--ranks 16] [--pops zipf]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.punica_kernels import graph_of, time_graph  # noqa: E402
from bench.lora_site import SITES, SLOTS  # noqa: E402
from lora_core.mapping import LoRAMapping  # noqa: E402
from lora_core.punica import PunicaWrapper  # noqa: E402
from tests.lora_core.punica_cases import stacked_weights, token_slots  # noqa: E402


def run_case(site: str, tokens: int, rank: int, popularity: str, none_fraction: float) -> tuple[list[float], float]:
    g = torch.Generator().manual_seed(tokens * 131 + rank)
    dtype = torch.bfloat16
    hidden, slices = SITES[site]
    a, b, ranks = stacked_weights(SLOTS, rank, hidden, slices, [rank], dtype, "cuda", g)
    slots = token_slots(tokens, SLOTS, popularity, g, none_fraction)
    ids = list(range(1, SLOTS + 1))
    by_slot = [ids[s] if s >= 0 else 0 for s in slots]
    mapping = LoRAMapping(by_slot, by_slot[:1], False)
    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
    w = torch.randn(sum(slices), hidden, device="cuda", dtype=dtype) / hidden ** 0.5
    wrapper = PunicaWrapper(tokens, SLOTS, "cuda", backend="triton")
    wrapper.update_metadata(mapping, ids)
    y = torch.empty(tokens, sum(slices), device="cuda", dtype=dtype)

    def base():
        torch.mm(x, w.t(), out=y)

    def addmm():
        y.addmm_(x, w.t())

    def rmw():
        torch.mm(x, w.t(), out=y)
        wrapper.add_lora_linear(y, x, a, b, None, 1.0, slices, ranks)

    def delta():
        y.copy_(wrapper.lora_linear(x, w, a, b, None, slices, ranks))

    def delta_only():
        wrapper.lora_linear(x, w, a, b, None, slices, ranks)

    if not hasattr(wrapper, "lora_linear"):  # a tree from before it: time its rmw twice
        delta = delta_only = rmw

    rmw()
    want = y.float().clone()
    delta()
    err = ((y.float() - want).abs().max() / want.abs().max()).item()
    return [time_graph(graph_of(fn)) for fn in (base, addmm, rmw, delta_only)], err


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sites", nargs="+", default=list(SITES))
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 512, 1024, 2048])
    p.add_argument("--ranks", type=int, nargs="+", default=[16])
    p.add_argument("--pops", nargs="+", default=["zipf", "identical"])
    p.add_argument("--none-fraction", type=float, default=0.1,
                   help="rows with no adapter (a piecewise prompt step pads with up to 25%%)")
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}; us per site, LoRA extra over base in ()")
    print(f"{'site':8} {'T':>5} {'r':>3} {'pop':9} {'base':>8} {'addmm':>8} {'rmw':>14} {'delta':>14} "
          f"{'delta/rmw':>9} {'err':>8}")
    for site in args.sites:
        for rank in args.ranks:
            for tokens in args.tokens:
                for pop in args.pops:
                    (t_base, t_addmm, t_rmw, t_delta), err = run_case(site, tokens, rank, pop, args.none_fraction)
                    print(f"{site:8} {tokens:5d} {rank:3d} {pop:9} {t_base:8.1f} {t_addmm:8.1f} "
                          f"{t_rmw:7.1f} ({t_rmw - t_base:4.1f}) {t_delta:7.1f} ({t_delta - t_base:4.1f}) "
                          f"{(t_delta - t_base) / (t_rmw - t_base):9.2f} {err:8.1e}", flush=True)


if __name__ == "__main__":
    main()
