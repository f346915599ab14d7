"""One LoRA site as a layer runs it: the base GEMM, then add_lora_linear (GPU).

For Llama-3-8B projections at decode-sized steps, each case times four CUDA graphs, replayed with
L2 flushed between them (bench/punica_kernels.py's helpers):
  base     y = x @ W^T (cuBLAS)
  no-pdl   base, then add_lora_linear with programmatic dependent launch off
  pdl      the same with it on (PunicaWrapper's default on Hopper)
  stacked  one GEMM over W and the A rows of the slots below the step's slot bound, then
           add_expand_stacked (lora_core/stacked_a.py; the engine's path for steps of <= 256 rows)
and prints each LoRA's extra time over base, and pdl's and stacked's over no-pdl's. A decode step runs
each projection once per layer (32 layers on 8B), so d us saved per site is ~32 d us per step. Run the
same script in another tree (git archive) to compare kernels side by side in one device call.

    python bench/lora_site.py [--sites qkv o gate_up down] [--tokens 1 8 32 64 256] [--ranks 16 64]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.punica_kernels import graph_of, time_graph  # noqa: E402
from lora_core.mapping import LoRAMapping  # noqa: E402
from lora_core.punica import PunicaWrapper  # noqa: E402
from lora_core.stacked_a import a_rows, stack_weight  # noqa: E402
from tests.lora_core.punica_cases import stacked_weights, token_slots  # noqa: E402

SLOTS = 32
SITES = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
         "down": (14336, (4096,))}


def run_case(site: str, tokens: int, rank: int, popularity: str) -> tuple[list[float], float, int]:
    """([base, no-pdl, pdl, stacked] us, max relative difference of pdl and stacked vs no-pdl, slot bound)."""
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
    wrappers.append(PunicaWrapper(max(tokens, 16), SLOTS, "cuda", backend="triton", stacked_max_tokens=tokens))
    for wrapper in wrappers:
        wrapper.update_metadata(mapping, ids)
    stacked = stack_weight(w, SLOTS, len(slices), rank)
    a_rows(stacked, w.shape[0], SLOTS, len(slices), rank).copy_(a.transpose(0, 1))
    bound = wrappers[2].stacked_rows()

    def site(wrapper):
        def run():
            y = torch.nn.functional.linear(x, w)
            wrapper.add_lora_linear(y, x, a, b, None, 1.0, slices, ranks)
            return y
        return run

    def stacked_site():
        out = torch.nn.functional.linear(x, stacked[:w.shape[0] + bound * len(slices) * rank])
        y = out[:, :w.shape[0]]
        wrappers[2].add_expand_stacked(y, out[:, w.shape[0]:], b, slices, ranks)
        return y

    runs = [lambda: torch.nn.functional.linear(x, w)] + [site(wr) for wr in wrappers[:2]] + [stacked_site]
    want = runs[1]().float()
    err = max(((run().float() - want).abs().max() / want.abs().max()).item() for run in runs[2:])
    return [time_graph(graph_of(fn)) for fn in runs], err, bound


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sites", nargs="+", default=list(SITES))
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64, 256])
    p.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    p.add_argument("--pops", nargs="+", default=["identical", "distinct"])
    a = p.parse_args()
    print(f"{'site':8}{'r':>4}{'T':>5} {'popularity':10}{'bound':>6}{'base us':>9}{'no-pdl +':>10}{'pdl +':>9}"
          f"{'stacked +':>11}{'pdl/no':>8}{'stk/no':>8}{'relerr':>9}")
    totals = [0.0, 0.0, 0.0]
    for site in a.sites:
        for rank in a.ranks:
            for tokens in a.tokens:
                for pop in a.pops:
                    (base, *lora), err, bound = run_case(site, tokens, rank, pop)
                    extra = [t - base for t in lora]
                    totals = [tot + e for tot, e in zip(totals, extra)]
                    ratios = [e / max(extra[0], 1e-3) for e in extra[1:]]
                    print(f"{site:8}{rank:>4}{tokens:>5} {pop:10}{bound:>6}{base:>9.2f}{extra[0]:>10.2f}"
                          f"{extra[1]:>9.2f}{extra[2]:>11.2f}{ratios[0]:>8.2f}{ratios[1]:>8.2f}{err:>9.1e}", flush=True)
    ratios = [t / max(totals[0], 1e-3) for t in totals[1:]]
    print(f"sum of LoRA extra over all cases: no-pdl {totals[0]:.1f} us, pdl {totals[1]:.1f} us ({ratios[0]:.2f}), "
          f"stacked {totals[2]:.1f} us ({ratios[1]:.2f})")


if __name__ == "__main__":
    main()
