"""The one-launch LoRA GEMM (lora_core/punica/lora_gemm.py) against cuBLAS and the engine's stacked path.

    python bench/lora_gemm.py --sweep            # base-only tilings per site (M rows), L2 flushed
    python bench/lora_gemm.py --in-situ          # + LoRA configs (one adapter), then 32 layers x 4 sites
                                                 #   in one graph per popularity (one / zipf / distinct)
    python bench/lora_gemm.py --in-situ --compact-slots  # the adapters in the lowest slots, as in the engine
    python bench/lora_gemm.py --in-situ --engine-tiling --a-splits 8   # the engine's settings, phase A split 8 ways

Columns: cuBLAS base GEMM (through replicas.layers.gemm.linear, the engine's front end: cublasLt at
17-64 rows); "stacked" = cuBLAS GEMM over [W ; A rows below the slot bound] then
add_expand_stacked (the engine's decode path); "fused" = LoRAGemm. In situ every layer has its own
weights (16 GB streamed per replay, so no L2 flush is needed), as a decode step sees them.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import numpy as np
import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.punica_kernels import graph_of, time_graph  # noqa: E402
from lora_core.mapping import LoRAMapping  # noqa: E402
from lora_core.punica import PunicaWrapper  # noqa: E402
from lora_core.punica.lora_gemm import RANK_CHUNK, LoRAGemm, reference, tiling  # noqa: E402
from lora_core.punica.metadata import adapter_bound, host_active  # noqa: E402
from lora_core.stacked_a import a_rows, stack_weight  # noqa: E402
from replicas.layers.gemm import linear  # noqa: E402
from tests.lora_core.punica_cases import token_slots  # noqa: E402

SITES = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
         "down": (14336, (4096,))}
SLOTS = 32
POPS = {"one": "identical", "zipf": "zipf", "distinct": "distinct"}


# Best base-only tilings of `--sweep` at M = 32 on an H100 (split_w 1, num_stages 4).
BASE_W = {"qkv": dict(block_n=32, block_k=128), "o": dict(block_n=32, block_k=256),
          "gate_up": dict(block_n=128, block_k=128), "down": dict(block_n=32, block_k=256)}
# Tilings the one-adapter LoRA sweep tries besides BASE_W (an earlier sweep's winners with LoRA).
LORA_W = {"qkv": dict(block_n=64, block_k=128), "o": dict(block_n=32, block_k=128),
          "gate_up": dict(block_n=64, block_k=128), "down": dict(block_n=32, block_k=128)}


def configs(n: int, k: int, slices, lora: bool, site: str, rank: int = 16):
    """LoRAGemm settings to time for a site: base-only tilings (W programs 96-2048), or LoRA variants."""
    if lora and rank > RANK_CHUNK:  # B gathered after the K loop; phase A's A tiles (block_ka x S*rank) and warps
        for w_tiles, block_ka, a_splits, warps in itertools.product(
                (BASE_W[site], LORA_W[site]), (32, 64), (4, 8, 16), (4, 8)):
            if n % w_tiles["block_n"] or any(s % w_tiles["block_n"] for s in slices):
                continue
            yield dict(w_tiles, split_w=1, num_stages=4, a_splits=a_splits, prefetch_b=False, block_ka=block_ka,
                       num_warps=warps)
        return
    if lora:  # the W tilings of earlier sweeps with phase A's split and the B prefetch varied, then W's grid
        seen = []
        for w_tiles, a_splits, prefetch in itertools.product((BASE_W[site], LORA_W[site]), (1, 4), (True, False)):
            seen.append(dict(w_tiles, split_w=1, num_stages=4, a_splits=a_splits, prefetch_b=prefetch))
            yield seen[-1]
        for bn, bk, split in itertools.product((32, 64), (128, 256), (1, 2, 4)):
            cfg = dict(block_n=bn, block_k=bk, split_w=split, num_stages=4, a_splits=4, prefetch_b=True)
            if n % bn or any(s % bn for s in slices) or k % (bk * split) or cfg in seen:
                continue
            yield cfg
        return
    for bn, bk, split, stages in itertools.product((32, 64, 128), (128, 256), (1, 2, 4, 8), (4,)):
        programs = n // bn * split
        if n % bn or any(s % bn for s in slices) or k % (bk * split) or not 96 <= programs <= 2048:
            continue
        yield dict(block_n=bn, block_k=bk, split_w=split, num_stages=stages)


def sweep(rows: int, sites: list[str], lora: bool, rank: int = 16) -> dict[str, dict]:
    """Best config per site, base only or with one adapter of this rank on every row."""
    best = {}
    for site in sites:
        k, slices = SITES[site]
        n = sum(slices)
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        y = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
        cublas = time_graph(graph_of(lambda: linear(x, w)))
        a = torch.randn(4, len(slices) * rank, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        b = torch.randn(4, n, rank, device="cuda", dtype=torch.bfloat16) / rank ** 0.5
        slots = torch.full((rows,), 2, dtype=torch.int32, device="cuda")
        row_active, active, num_active = (torch.from_numpy(t).cuda() for t in host_active(slots.cpu().numpy(), 4))
        want = (reference(x, w, a, b, slots.cpu(), slices, rank) if lora
                else torch.nn.functional.linear(x, w).float())
        rows_out = []
        for cfg in configs(n, k, slices, lora, site, rank):
            g = LoRAGemm(n, k, slices, rank, rows, int(lora), "cuda", **cfg)
            run = lambda g=g: g(y, x, w, a, b, slots, row_active, active, num_active)  # noqa: E731
            try:
                run()
            except triton.runtime.errors.OutOfResources:
                continue
            err = ((y.float() - want).abs().max() / want.abs().max()).item()
            us = time_graph(graph_of(run))
            rows_out.append((us, cfg, err))
        rows_out.sort(key=lambda r: r[0])
        print(f"{site} M={rows}{' one adapter' if lora else ''}: cuBLAS {cublas:.2f} us; best fused:")
        for us, cfg, err in rows_out[:5]:
            print(f"   {us:8.2f} us  x cuBLAS {us / cublas:5.2f}  {cfg}  relerr {err:.1e}")
        best[site] = rows_out[0][1]
    return best


class Site:
    """One layer's site: stacked weight, B slots, a LoRAGemm."""

    def __init__(self, name: str, rows: int, rank: int, cfg: dict, max_active: int) -> None:
        k, slices = SITES[name]
        self.n, self.k, self.slices, self.rank = sum(slices), k, slices, rank
        w = torch.randn(self.n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        self.stacked = stack_weight(w, SLOTS, len(slices), rank)
        del w
        a_rows(self.stacked, self.n, SLOTS, len(slices), rank).normal_(0, k ** -0.5)
        self.a = self.stacked[self.n:].view(SLOTS, len(slices) * rank, k)
        self.b = torch.randn(SLOTS, self.n, rank, device="cuda", dtype=torch.bfloat16) / rank ** 0.5
        self.gemm = LoRAGemm(self.n, k, slices, rank, rows, max_active, "cuda", **cfg)


def in_situ(rows: int, rank: int, layers: int, best: dict, best_lora: dict, pops: list[str],
            compact: bool) -> None:
    g = torch.Generator().manual_seed(7)
    print(f"in situ: {layers} layers x 4 sites, M={rows}, rank {rank}; us per step")
    for pop in pops:
        slots = token_slots(rows, SLOTS, POPS[pop], g)
        if compact:  # the step's adapters in the lowest slots, as the engine's eviction tends to keep them
            order = {s: i for i, s in enumerate(sorted(set(slots)))}
            slots = [order[s] for s in slots]
        row_act, active, num_active = (torch.from_numpy(t).cuda()
                                       for t in host_active(np.array(slots, dtype=np.int32), SLOTS))
        bound_a = adapter_bound(int(num_active), SLOTS)
        sites = [{name: Site(name, rows, rank, best_lora[name], bound_a) for name in SITES} for _ in range(layers)]
        base_gemms = {name: LoRAGemm(sum(sl), k, sl, rank, rows, 0, "cuda", **best[name])
                      for name, (k, sl) in SITES.items()}
        xs = {k: torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for k, _ in SITES.values()}
        ys = {name: torch.empty(rows, sum(sl), device="cuda", dtype=torch.bfloat16) for name, (_, sl) in SITES.items()}
        slots_t = torch.tensor(slots, dtype=torch.int32, device="cuda")
        ids = list(range(1, SLOTS + 1))
        punica = PunicaWrapper(max(rows, 16), SLOTS, "cuda", backend="triton", stacked_max_tokens=rows)
        punica.update_metadata(LoRAMapping([ids[s] for s in slots], [ids[slots[0]]], False), ids)
        bound = punica.stacked_rows()
        ranks = torch.full((3, SLOTS), rank, dtype=torch.int32, device="cuda")

        def base():
            for layer in sites:
                for name, st in layer.items():
                    linear(xs[st.k], st.stacked[:st.n])

        def stacked():
            for layer in sites:
                for name, st in layer.items():
                    out = linear(xs[st.k], st.stacked[:st.n + bound * len(st.slices) * rank])
                    punica.add_expand_stacked(out[:, :st.n], out[:, st.n:], st.b, st.slices,
                                              ranks[:len(st.slices)])

        def fused():
            for layer in sites:
                for name, st in layer.items():
                    st.gemm(ys[name], xs[st.k], st.stacked[:st.n], st.a, st.b, slots_t, row_act, active, num_active)

        def fused_base():
            for layer in sites:
                for name, st in layer.items():
                    base_gemms[name](ys[name], xs[st.k], st.stacked[:st.n], st.a, st.b, slots_t, row_act, active,
                                     num_active)

        # correctness of one layer's sites against the torch reference
        errs = []
        for name, st in sites[0].items():
            st.gemm(ys[name], xs[st.k], st.stacked[:st.n], st.a, st.b, slots_t, row_act, active, num_active)
            want = reference(xs[st.k], st.stacked[:st.n], st.a, st.b, slots_t.cpu(), st.slices, rank)
            errs.append(((ys[name].float() - want).abs().max() / want.abs().max()).item())
        times = {fn.__name__: time_graph(graph_of(fn)) for fn in (base, fused_base, stacked, fused)}
        b = times["base"]
        print(f"  {pop:9} adapters {int(num_active):2} (bound {bound}, maxa {bound_a}): cuBLAS base {b:8.1f}  "
              f"fused base {times['fused_base']:8.1f} ({times['fused_base'] / b:.3f})  "
              f"stacked {times['stacked']:8.1f} (+{times['stacked'] - b:6.1f})  "
              f"fused {times['fused']:8.1f} (+{times['fused'] - b:6.1f})  relerr {max(errs):.1e}", flush=True)
        sites.clear()
        torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--sites", nargs="+", default=list(SITES))
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--pops", nargs="+", default=list(POPS))
    p.add_argument("--in-situ", action="store_true")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--compact-slots", action="store_true",
                   help="in situ: the step's adapters in slots 0..n-1 (a low slot bound for the stacked path)")
    p.add_argument("--engine-tiling", action="store_true",
                   help="in situ: the engine's settings (lora_gemm.tiling) instead of a one-adapter sweep's best")
    p.add_argument("--a-splits", type=int, help="in situ: phase A's K splits instead of the settings' own")
    a = p.parse_args()
    best = sweep(a.rows, a.sites, False) if a.sweep else BASE_W
    if a.in_situ:
        if a.engine_tiling:
            best_lora = {name: tiling(sum(sl), k, sl, a.rank) for name, (k, sl) in SITES.items()}
        else:
            best_lora = sweep(a.rows, a.sites, True, a.rank)
        if a.a_splits:
            best_lora = {name: dict(cfg, a_splits=a.a_splits) for name, cfg in best_lora.items()}
        print(f"in situ LoRA settings: {best_lora}")
        in_situ(a.rows, a.rank, a.layers, best, best_lora, a.pops, a.compact_slots)


if __name__ == "__main__":
    main()
