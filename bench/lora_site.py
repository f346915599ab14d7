"""One LoRA site as a layer runs it: the base GEMM, then add_lora_linear (GPU).

For Llama-3-8B projections at decode-sized steps, each case times three CUDA graphs, replayed with
L2 flushed between them (bench/kernels.py's helpers):
  base     y = x @ W^T (cuBLAS)
  no-pdl   base, then add_lora_linear with programmatic dependent launch off
  pdl      the same with it on (PunicaWrapper's default on Hopper)
and prints each LoRA's extra time over base, and pdl's over no-pdl's. A decode step runs each
projection once per layer (32 layers on 8B), so d us saved per site is ~32 d us per step. Run the
same script in another tree (git archive) to compare kernels side by side in one device call.

    python bench/lora_site.py [--sites qkv o gate_up down] [--tokens 1 8 32 64 256] [--ranks 16 64]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.kernels import graph_of, time_graph  # noqa: E402
from lora_core.mapping import LoRAMapping  # noqa: E402
from lora_core.punica import PunicaWrapper  # noqa: E402
from tests.lora_core.punica_cases import stacked_weights, token_slots  # noqa: E402

SLOTS = 32
SITES = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
         "down": (14336, (4096,))}


def run_case(site: str, tokens: int, rank: int, popularity: str) -> tuple[float, float, float, float]:
    """(base us, no-pdl us, pdl us, max relative difference pdl vs no-pdl)."""
    g = torch.Generator().manual_seed(tokens * 131 + rank)
    dtype = torch.bfloat16
    hidden, slices = SITES[site]
    a, b, ranks = stacked_weights(SLOTS, rank, hidden, slices, [rank], dtype, "cuda", g)
    slots = token_slots(tokens, SLOTS, popularity, g)
    ids = list(range(1, SLOTS + 1))
    mapping = LoRAMapping([ids[s] for s in slots], [ids[slots[0]]], False)
    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
    w = torch.randn(sum(slices), hidden, device="cuda", dtype=dtype) / hidden ** 0.5
    wrappers = [PunicaWrapper(max(tokens, 16), SLOTS, "cuda", backend="triton", use_pdl=pdl) for pdl in (False, True)]
    for wrapper in wrappers:
        wrapper.update_metadata(mapping, ids)

    def site(wrapper):
        def run():
            y = torch.nn.functional.linear(x, w)
            wrapper.add_lora_linear(y, x, a, b, None, 1.0, slices, ranks)
            return y
        return run

    runs = [lambda: torch.nn.functional.linear(x, w)] + [site(wr) for wr in wrappers]
    want, got = runs[1]().float(), runs[2]().float()
    err = ((got - want).abs().max() / want.abs().max()).item()
    times = [time_graph(graph_of(fn)) for fn in runs]
    return times[0], times[1], times[2], err


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sites", nargs="+", default=list(SITES))
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64, 256])
    p.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    p.add_argument("--pops", nargs="+", default=["identical", "distinct"])
    a = p.parse_args()
    print(f"{'site':8}{'r':>4}{'T':>5} {'popularity':10}{'base us':>9}{'no-pdl +':>10}{'pdl +':>9}"
          f"{'pdl/no':>8}{'relerr':>9}")
    totals = [0.0, 0.0]
    for site in a.sites:
        for rank in a.ranks:
            for tokens in a.tokens:
                for pop in a.pops:
                    base, nopdl, pdl, err = run_case(site, tokens, rank, pop)
                    totals[0] += nopdl - base
                    totals[1] += pdl - base
                    print(f"{site:8}{rank:>4}{tokens:>5} {pop:10}{base:>9.2f}{nopdl - base:>10.2f}{pdl - base:>9.2f}"
                          f"{(pdl - base) / max(nopdl - base, 1e-3):>8.2f}{err:>9.1e}", flush=True)
    print(f"sum of LoRA extra over all cases: no-pdl {totals[0]:.1f} us, pdl {totals[1]:.1f} us "
          f"(ratio {totals[1] / max(totals[0], 1e-3):.2f})")


if __name__ == "__main__":
    main()
