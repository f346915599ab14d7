"""A stacked LoRA expand as its own kernel vs added by the pointwise op after the layer (GPU).

--sites gate_up: SiluAndMul adds gate_up_proj's expand as it reads gate and up; --sites qkv: the rotary
kernel adds qkv_proj's as it rotates q and k (v's part in place; replicas/kernels/lora_rotary.py);
--sites o / down: the add + RMSNorm after o_proj / down_proj adds theirs (replicas/kernels/lora_norm.py).

lora_core/punica/pending.py. For Llama-3-8B's gate_up_proj (4096 -> 2 x 14336) at decode-sized steps, each
case times three CUDA graphs, replayed with L2 flushed between them (bench/punica_kernels.py's helpers):
  base     y = x @ W^T, then silu_and_mul
  expand   one GEMM over W and the A rows of the step's slots, add_expand_stacked, then silu_and_mul
  pending  the same GEMM, then silu_and_mul with the PendingExpand (no expand kernel)
and prints each LoRA's extra time over base and pending's saving (a decode step of the 8B model runs 32 such
sites). Outputs of expand and pending are compared in the same run.

    python bench/pending_expand.py --sites qkv --blocks 1 2 4 --adapters 1 4 10 32   # heads per rotary program
    python bench/pending_expand.py [--tokens 8 32] [--adapters 1 4 10 32] [--ranks 16 64] [--blocks 64 128 256]

(A first version of this script also fused o_proj's and down_proj's expands into the next add +
RMSNorm with one program per row, which streamed each row's B: 3-11 us slower than the expand kernel on an
H200; bench/RESULTS.md, fourteenth session. lora_norm.py's programs take column chunks instead.)
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.punica_kernels import graph_of, time_graph  # noqa: E402
from bench.lora_site import SITES, SLOTS  # noqa: E402
from bench.stacked_expand import slots_for  # noqa: E402
from lora_core.mapping import LoRAMapping  # noqa: E402
from lora_core.punica import PunicaWrapper  # noqa: E402
from replicas.kernels import fused, lora_norm, lora_rotary  # noqa: E402
from replicas.layers import RotaryEmbedding  # noqa: E402
from tests.lora_core.punica_cases import stacked_weights  # noqa: E402

def run(site: str, tokens: int, adapters: int, rank: int, block: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(tokens * 7 + adapters + rank)
    hidden, slices = SITES[site]
    out = sum(slices)
    _, b, ranks = stacked_weights(SLOTS, rank, hidden, slices, [rank], torch.bfloat16, "cuda", g)
    slots = slots_for(tokens, adapters, g)
    ids = list(range(1, SLOTS + 1))
    punica = PunicaWrapper(max(tokens, 16), SLOTS, "cuda", backend="triton", stacked_max_tokens=tokens,
                           pending_max_tokens=tokens, pending_min_adapters=1)
    punica.update_metadata(LoRAMapping([ids[s] for s in slots], [ids[slots[0]]], False), ids)
    rows = out + punica.stacked_rows() * len(slices) * rank
    w = (torch.randn(rows, hidden, generator=g) / hidden ** 0.5).to("cuda", torch.bfloat16)
    x = torch.randn(tokens, hidden, generator=g).to("cuda", torch.bfloat16)
    if site == "gate_up":
        fused.LORA_SILU_BLOCK = block
        op = fused.silu_and_mul
    elif site in ("o", "down"):  # the add + RMSNorm after the layer: its normed output and the new residual
        lora_norm.LORA_NORM_BLOCK = block
        residual = torch.randn(tokens, out, generator=g).to("cuda", torch.bfloat16)
        weight = (1 + torch.randn(out, generator=g) / 10).to("cuda", torch.bfloat16)

        def op(y, lora=None):
            if lora is None:
                return fused.fused_add_rms_norm(y, residual, weight, 1e-5)
            return lora_norm.add_rms_norm_lora(y, residual, weight, 1e-5, lora)
    else:  # qkv: rotary of q and k (the pending expand's v part lands in place)
        lora_rotary.LORA_ROTARY_HEADS = block
        rope = RotaryEmbedding(128, 500000.0).cuda()
        positions = torch.arange(tokens, device="cuda") * 13

        def op(y, lora=None):
            q, k, v = y.split(slices, -1)
            return torch.cat(rope(positions, q, k, lora=lora, v=v), -1)

    results = {}

    def base():
        results["base"] = op(x @ w[:out].T)

    def expand():
        whole = x @ w.T
        y = whole[:, :out]
        punica.add_expand_stacked(y, whole[:, out:], b, slices, ranks)
        results["expand"] = op(y)

    def pending():
        whole = x @ w.T
        pending = punica.pending_expand(whole[:, :out], whole[:, out:], b, slices, ranks)
        assert pending is not None
        results["pending"] = op(whole[:, :out], lora=pending)

    times = {name: time_graph(graph_of(fn)) for name, fn in (("base", base), ("expand", expand),
                                                               ("pending", pending))}
    pend, exp = (torch.cat(r, -1) if isinstance(r, tuple) else r for r in (results["pending"], results["expand"]))
    diff = ((pend.float() - exp.float()).abs().max() / exp.float().abs().max()).item()
    return times | {"diff": diff}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sites", nargs="+", default=["gate_up"], choices=["gate_up", "qkv", "o", "down"])
    p.add_argument("--tokens", type=int, nargs="+", default=[32])
    p.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 10, 32])
    p.add_argument("--ranks", type=int, nargs="+", default=[16])
    p.add_argument("--blocks", type=int, nargs="+", default=None,
                   help="gate_up: fused.LORA_SILU_BLOCK (columns per program); qkv: lora_rotary.LORA_ROTARY_HEADS; "
                        "o, down: lora_norm.LORA_NORM_BLOCK")
    a = p.parse_args()
    print(f"device {torch.cuda.get_device_name()}  bfloat16  slots {SLOTS}; us per graph replay, L2 flushed")
    print(f"{'site':8} {'r':>3} {'T':>4} {'ad':>3} {'block':>5} {'base':>8} {'expand':>8} {'pending':>8} "
          f"{'+expand':>8} {'+pending':>8} {'saved':>7} {'ratio':>6} {'rel diff':>9}")
    for site, rank, tokens, adapters in itertools.product(a.sites, a.ranks, a.tokens, a.adapters):
        defaults = [{"gate_up": fused.LORA_SILU_BLOCK, "qkv": lora_rotary.LORA_ROTARY_HEADS}.get(
            site, lora_norm.LORA_NORM_BLOCK)]
        for block in a.blocks or defaults:
            r = run(site, tokens, adapters, rank, block)
            extra_e, extra_p = r["expand"] - r["base"], r["pending"] - r["base"]
            print(f"{site:8} {rank:3} {tokens:4} {adapters:3} {block:5} {r['base']:8.2f} {r['expand']:8.2f} "
                  f"{r['pending']:8.2f} {extra_e:8.2f} {extra_p:8.2f} {extra_e - extra_p:7.2f} "
                  f"{r['pending'] / r['expand']:6.3f} {r['diff']:9.2e}", flush=True)


if __name__ == "__main__":
    main()
