"""SGMV launch settings at prompt sizes: shrink (BLOCK_K, stages, K splits) and expand (splits, BLOCK_N, warps,
y read back or only written), each kernel alone, against the plan triton_ops makes (GPU).

Launches the kernels directly with fixed settings (no device deal: every tile gets the splits given), times
CUDA graphs replayed with L2 flushed, and prints per case the plan's time and the six best settings. The
settings behind triton_ops' prompt-sized plans (shrink_config's BLOCK_K, _SGMV_EXPAND_BLOCK_N) came from it.

    python bench/sgmv_plans.py [--sites qkv o gate_up down] [--tokens 256 1024 2048] [--pops zipf identical]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.punica_kernels import graph_of  # noqa: E402
from bench.lora_site import SITES, SLOTS  # noqa: E402
from lora_core.mapping import LoRAMapping  # noqa: E402
from lora_core.punica import PunicaWrapper  # noqa: E402
from lora_core.punica import triton_ops as ops  # noqa: E402
from lora_core.punica.triton_kernels import expand_kernel, shrink_kernel  # noqa: E402
from tests.lora_core.punica_cases import stacked_weights, token_slots  # noqa: E402


def _us(fn) -> float:
    # Shorter than bench.punica_kernels.time_graph: a case times ~80 settings.
    return 1e3 * do_bench(graph_of(fn).replay, warmup=5, rep=40, return_mode="median")


def run_case(site: str, tokens: int, pop: str, rank: int = 16) -> list[str]:
    g = torch.Generator().manual_seed(tokens)
    hidden, slices = SITES[site]
    a, b, ranks = stacked_weights(SLOTS, rank, hidden, slices, [rank], torch.bfloat16, "cuda", g)
    slots = token_slots(tokens, SLOTS, pop, g)
    ids = list(range(1, SLOTS + 1))
    w = PunicaWrapper(tokens, SLOTS, "cuda", backend="triton")
    w.update_metadata(LoRAMapping([ids[s] for s in slots], [ids[slots[0]]], False), ids)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(tokens, sum(slices), device="cuda", dtype=torch.bfloat16)
    meta, num_slices, offs = w.token_meta, len(slices), w._offsets(slices)
    buf = torch.zeros(32, num_slices, tokens, rank, device="cuda")
    shrinks = {}
    for bk, stages, splits in itertools.product((64, 128, 256), (2, 3, 4), (1, 2, 4, 8, 16)):
        if splits * bk <= 2 * hidden:
            shrinks[f"bk{bk} st{stages} s{splits}"] = _us(lambda: shrink_kernel[(meta.max_tiles, splits, num_slices)](
                x, a, buf, ranks, meta.sorted_idx, meta.tile_lora, meta.tile_start, meta.tile_end, meta.num_tiles,
                hidden, 1.0, splits, 0, x.stride(0), x.stride(1), *a.stride(), *buf.stride(), ranks.stride(0),
                R=rank, BLOCK_M=meta.block_m, BLOCK_R=16, BLOCK_K=bk, ACCUMULATE=False, USE_PDL=False, IEEE=False,
                PREFETCH_A=False, num_warps=4, num_stages=stages))
    expands = {True: {}, False: {}}
    for splits, bn, warps, add in itertools.product((1, 2, 4), (64, 128, 256), (4, 8), (True, False)):
        n_blocks = -(-max(slices) // bn)
        chunks = max(1, min(n_blocks, -(-2 * 1024 // (meta.max_tiles * num_slices))))
        grid = (meta.max_tiles, -(-n_blocks // -(-n_blocks // chunks)), num_slices)
        expands[add][f"s{splits} bn{bn} w{warps}"] = _us(lambda: expand_kernel[grid](
            buf, b, y, ranks, offs, b, meta.sorted_idx, meta.tile_lora, meta.tile_start, meta.tile_end,
            meta.num_tiles, 0, splits, splits, 0, n_blocks, 0, meta.max_tiles, tokens,
            *buf.stride(), 0, *b.stride(), y.stride(0), y.stride(1), ranks.stride(0), 0,
            BLOCK_M=meta.block_m, BLOCK_N=bn, BLOCK_R=16, HAS_BIAS=False, ADD_INPUTS=add, USE_PDL=False,
            IEEE=False, ZERO_BASE=False, RANK_GROUP=1, num_warps=warps, num_stages=3))
    block_k, splits, cap = ops.shrink_config(meta, hidden, num_slices, rank, False)
    plan_s = _us(lambda: ops.shrink(buf, x, a, ranks, meta, 1.0, False, splits, block_k))
    plan_e = {add: _us(lambda: ops.expand(y, buf[:cap], b, ranks, offs, max(slices), meta, 0, None, add,
                                          shrink_splits=splits)) for add in (True, False)}
    ybytes = tokens * sum(slices) * 2

    def best(d: dict) -> str:
        return "; ".join(f"{k} {v:.1f}" for k, v in sorted(d.items(), key=lambda kv: kv[1])[:6])
    return [f"== {site} T={tokens} {pop} block_m={meta.block_m} tiles<={meta.max_tiles}; at 4.5 TB/s x takes "
            f"{tokens * hidden * 2 / 4.5e6:.1f} us, y's write {ybytes / 4.5e6:.1f}",
            f"  shrink  plan (bk{block_k} s{splits}) {plan_s:.1f}; best: {best(shrinks)}",
            f"  expand read y   plan {plan_e[True]:.1f}; best: {best(expands[True])}",
            f"  expand write y  plan {plan_e[False]:.1f}; best: {best(expands[False])}"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sites", nargs="+", default=list(SITES))
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 2048])
    p.add_argument("--pops", nargs="+", default=["zipf", "identical"])
    args = p.parse_args()
    print(torch.cuda.get_device_name(), "us per launch, rank 16")
    for site in args.sites:
        for tokens in args.tokens:
            for pop in args.pops:
                print("\n".join(run_case(site, tokens, pop)), flush=True)


if __name__ == "__main__":
    main()
