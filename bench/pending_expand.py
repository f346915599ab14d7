"""gate_up_proj's stacked LoRA expand as its own kernel vs added by SiluAndMul as it reads gate and up (GPU).

lora_core/punica/pending.py. For Llama-3-8B's gate_up_proj (4096 -> 2 x 14336) at decode-sized steps, each
case times three CUDA graphs, replayed with L2 flushed between them (bench/kernels.py's helpers):
  base     y = x @ W^T, then silu_and_mul
  expand   one GEMM over W and the A rows of the step's slots, add_expand_stacked, then silu_and_mul
  pending  the same GEMM, then silu_and_mul with the PendingExpand (no expand kernel)
and prints each LoRA's extra time over base and pending's saving (a decode step of the 8B model runs 32 such
sites). Outputs of expand and pending are compared in the same run.

    python bench/pending_expand.py [--tokens 8 32] [--adapters 1 4 10 32] [--ranks 16 64] [--blocks 64 128 256]

(A first version of this script also fused o_proj's and down_proj's expands into the next add +
RMSNorm: one program per row streamed each row's B, 3-11 us slower than the expand kernel on an H200;
bench/RESULTS.md, fourteenth session.)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.kernels import graph_of, time_graph  # noqa: E402
from bench.lora_site import SITES, SLOTS  # noqa: E402
from bench.stacked_expand import slots_for  # noqa: E402
from lora_core.mapping import LoRAMapping  # noqa: E402
from lora_core.punica import PunicaWrapper  # noqa: E402
from replicas.kernels import fused  # noqa: E402
from tests.lora_core.punica_cases import stacked_weights  # noqa: E402

def run(tokens: int, adapters: int, rank: int, block: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(tokens * 7 + adapters + rank)
    hidden, slices = SITES["gate_up"]
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
    fused.LORA_SILU_BLOCK = block
    op = fused.silu_and_mul

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
        pending = punica.pending_expand(whole[:, out:], b, slices, ranks)
        assert pending is not None
        results["pending"] = op(whole[:, :out], lora=pending)

    times = {name: time_graph(graph_of(fn)) for name, fn in (("base", base), ("expand", expand),
                                                               ("pending", pending))}
    diff = ((results["pending"].float() - results["expand"].float()).abs().max()
            / results["expand"].float().abs().max()).item()
    return times | {"diff": diff}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[32])
    p.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 10, 32])
    p.add_argument("--ranks", type=int, nargs="+", default=[16])
    p.add_argument("--blocks", type=int, nargs="+", default=[fused.LORA_SILU_BLOCK], help="fused.LORA_SILU_BLOCK")
    a = p.parse_args()
    print(f"device {torch.cuda.get_device_name()}  bfloat16  slots {SLOTS}; us per graph replay, L2 flushed")
    print(f"{'r':>3} {'T':>4} {'ad':>3} {'block':>5} {'base':>8} {'expand':>8} {'pending':>8} "
          f"{'+expand':>8} {'+pending':>8} {'saved':>7} {'ratio':>6} {'rel diff':>9}")
    for rank in a.ranks:
        for tokens in a.tokens:
            for adapters in a.adapters:
                for block in a.blocks:
                    r = run(tokens, adapters, rank, block)
                    extra_e, extra_p = r["expand"] - r["base"], r["pending"] - r["base"]
                    print(f"{rank:3} {tokens:4} {adapters:3} {block:5} {r['base']:8.2f} {r['expand']:8.2f} "
                          f"{r['pending']:8.2f} {extra_e:8.2f} {extra_p:8.2f} {extra_e - extra_p:7.2f} "
                          f"{r['pending'] / r['expand']:6.3f} {r['diff']:9.2e}", flush=True)


if __name__ == "__main__":
    main()
