"""Probe: the shrink as extra rows of the base GEMM (x @ [W; A_slots]^T), then the expand reads its
input from the GEMM output's tail. Compared with base GEMM + add_lora_linear (pdl) per site."""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.kernels import graph_of, time_graph  # noqa: E402
from lora_core.mapping import LoRAMapping  # noqa: E402
from lora_core.punica import PunicaWrapper, triton_ops  # noqa: E402
from lora_core.punica.metadata import adapter_bound  # noqa: E402
from tests.lora_core.punica_cases import stacked_weights, token_slots  # noqa: E402

SLOTS = 32
SITES = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
         "down": (14336, (4096,))}


def run_case(site, tokens, rank, popularity):
    g = torch.Generator().manual_seed(tokens * 131 + rank)
    dtype = torch.bfloat16
    hidden, slices = SITES[site]
    S, N = len(slices), sum(slices)
    a, b, ranks = stacked_weights(SLOTS, rank, hidden, slices, [rank], dtype, "cuda", g)
    slots = token_slots(tokens, SLOTS, popularity, g)
    ids = list(range(1, SLOTS + 1))
    mapping = LoRAMapping([ids[s] for s in slots], [ids[slots[0]]], False)
    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
    w = torch.randn(N, hidden, device="cuda", dtype=dtype) / hidden ** 0.5
    w_cat = torch.cat([w, a.permute(1, 0, 2, 3).reshape(SLOTS * S * rank, hidden)])
    wr = PunicaWrapper(max(tokens, 16), SLOTS, "cuda", backend="triton", use_pdl=True)
    wr.update_metadata(mapping, ids)
    meta = wr.token_meta
    bound = adapter_bound(meta.num_adapters, SLOTS)
    rows = N + bound * S * rank
    offsets = wr._offsets(slices)

    def base():
        return torch.nn.functional.linear(x, w)

    def cur():
        y = torch.nn.functional.linear(x, w)
        wr.add_lora_linear(y, x, a, b, None, 1.0, slices, ranks)
        return y

    def cat():
        yc = torch.nn.functional.linear(x, w_cat[:rows])
        y = yc[:, :N]
        tail = yc[:, N:]
        buf = tail.as_strided((1, S, tokens, rank), (0, rank, yc.stride(0), 1))
        triton_ops.expand(y, buf, b, ranks, offsets, max(slices), meta, 0, None, True, use_pdl=True,
                          buf_slot_stride=S * rank)
        return y

    want, got = cur().float(), cat().float()
    err = ((got - want).abs().max() / want.abs().max()).item()
    t = [time_graph(graph_of(fn)) for fn in (base, cur, cat)]
    return t, err, bound


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sites", nargs="+", default=list(SITES))
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    p.add_argument("--pops", nargs="+", default=["identical", "distinct", "zipf"])
    args = p.parse_args()
    print(f"{'site':8}{'r':>4}{'T':>5} {'pop':10}{'bound':>6}{'base us':>9}{'cur +':>8}{'cat +':>8}{'cat/cur':>8}{'err':>9}")
    tot = [0.0, 0.0]
    for site in args.sites:
        for rank in args.ranks:
            for tokens in args.tokens:
                for pop in args.pops:
                    (b0, c1, c2), err, bound = run_case(site, tokens, rank, pop)
                    tot[0] += c1 - b0
                    tot[1] += c2 - b0
                    print(f"{site:8}{rank:>4}{tokens:>5} {pop:10}{bound:>6}{b0:>9.2f}{c1 - b0:>8.2f}{c2 - b0:>8.2f}"
                          f"{(c2 - b0) / max(c1 - b0, 1e-3):>8.2f}{err:>9.1e}", flush=True)
    print(f"sum of LoRA extra: current {tot[0]:.1f} us, gemm-shrink {tot[1]:.1f} us ({tot[1] / tot[0]:.2f})")


if __name__ == "__main__":
    main()
