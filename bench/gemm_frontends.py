"""cuBLAS's two front ends side by side on the GEMMs of a Llama-3-8B step (GPU): which picks faster kernels?

torch sends x @ W^T to cublasGemmEx, or to cublasLt where
torch.backends.cuda.preferred_blas_library("cublaslt") says so; each asks its
own heuristic for a kernel. For every site, row count T and stacked-LoRA slot
bound (bound x slices x rank A rows under the base weight, lora_core/stacked_a.py;
0 = the base GEMM), this captures --layers GEMMs of distinct weights back to
back in one CUDA graph (the step's weights stream through L2 as in the engine,
so no flush is needed) under each front end, and prints us per GEMM and the
ratio. replicas/layers/gemm.py takes its row range from this. --split adds, for
stacked bounds, the base GEMM and the shrink as two GEMMs (W rows, then the A
rows alone) under each front end: what splitting a stacked GEMM whose row count
gets a slow kernel would cost.

    python bench/gemm_frontends.py
    python bench/gemm_frontends.py --sites o down --tokens 16 24 32 --bounds 0 16
    python bench/gemm_frontends.py --sites lm_head --tokens 1 8 16 32 64 --bounds 0
    python bench/gemm_frontends.py --sites gate_up --tokens 16 24 32 48 --bounds 4 16 32 --split
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.punica_kernels import graph_of  # noqa: E402

# site: (K, N, LoRA slices)
SITES = {"qkv": (4096, 6144, 3), "o": (4096, 4096, 1), "gate_up": (4096, 28672, 2), "down": (14336, 4096, 1),
         "lm_head": (4096, 128256, 1)}


def time_frontend(weights: list[torch.Tensor], rows: int, tokens: int, frontend: str, split: int = 0) -> float:
    """us per layer: x [tokens, K] @ w[:rows]^T for every w, captured with `frontend` preferred; split > 0:
    x @ w[:split]^T, then x @ w[split:rows]^T (two GEMMs)."""
    from triton.testing import do_bench

    x = torch.randn(tokens, weights[0].shape[1], device="cuda", dtype=weights[0].dtype)
    outs: list[torch.Tensor | None] = [None] * (2 * len(weights))

    def step():
        for i, w in enumerate(weights):
            if split:
                outs[2 * i], outs[2 * i + 1] = x @ w[:split].T, x @ w[split:rows].T
            else:
                outs[2 * i] = x @ w[:rows].T

    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(frontend)
    try:
        graph = graph_of(step)
    finally:
        torch.backends.cuda.preferred_blas_library(before)
    return 1e3 * do_bench(graph.replay, warmup=5, rep=60, return_mode="median") / len(weights)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sites", nargs="+", default=["o", "down", "qkv", "gate_up"], choices=sorted(SITES))
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16, 24, 32, 48, 64, 128, 256, 512, 1024])
    p.add_argument("--bounds", type=int, nargs="+", default=[0, 4, 16, 32])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--layers", type=int, default=32, help="GEMMs of distinct weights per graph (lm_head: 4)")
    p.add_argument("--split", action="store_true", help="also the base GEMM and the shrink as two GEMMs")
    a = p.parse_args()
    print(f"device {torch.cuda.get_device_name()}  bfloat16  us per layer, back to back in one CUDA graph")
    print(f"{'site':8} {'T':>5} {'bound':>5} {'cublas':>8} {'cublaslt':>9} {'lt/cublas':>9}"
          + (f" {'split':>8} {'split lt':>9}" if a.split else ""))
    for site in a.sites:
        k, n, slices = SITES[site]
        extra = max(a.bounds) * slices * a.rank
        layers = 4 if site == "lm_head" else a.layers
        weights = [torch.randn(n + extra, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(layers)]
        for tokens in a.tokens:
            for bound in a.bounds:
                rows = n + bound * slices * a.rank
                gemm_ex = time_frontend(weights, rows, tokens, "cublas")
                lt = time_frontend(weights, rows, tokens, "cublaslt")
                line = f"{site:8} {tokens:5} {bound:5} {gemm_ex:8.2f} {lt:9.2f} {lt / gemm_ex:9.3f}"
                if a.split and bound:
                    line += "".join(f" {time_frontend(weights, rows, tokens, f, split=n):{w}.2f}"
                                    for f, w in (("cublas", 8), ("cublaslt", 9)))
                print(line, flush=True)
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
