"""linear(x, W, b): F.linear, with cuBLAS's Lt front end for the row counts where it picks faster kernels.

torch runs a half-precision x @ W^T through cublasGemmEx unless
torch.backends.cuda.preferred_blas_library() says "cublaslt". The two ask
different heuristics, which for a decode step's skinny GEMMs pick different
kernels. On an H200 (Llama-3-8B shapes, 32 layers' GEMMs in one CUDA graph;
bench/gemm_frontends.py), through
cublasLt: o_proj at 32 rows 14.1 -> 12.1 us, down_proj 34.0 -> 31.3, and with
the 256 A rows of a stacked LoRA step (lora_core/stacked_a.py), where
cublasGemmEx's pick is worst, 15.6 -> 12.6 and 39.8 -> 33.0. From 24 to 64
rows cublasLt was never more than 1.4% slower on any site; at 8-16 rows it was
up to 12% slower on down_proj, and from 128 rows neither won everywhere. An
H100 agrees from 24 to 64 rows (o_proj within 1.3%, down_proj 7-15% faster).
So GEMMs of CUBLASLT_ROWS rows take cublasLt and every other one the default.

The choice is a process-wide torch setting, set for the one call and put back
under a lock (engines in threads of one process must not take each other's),
and it is read when the GEMM is launched, so a CUDA graph keeps the kernel
picked at capture. env LORAFLEET_CUBLASLT_ROWS="lo-hi" sets the range, "0"
turns it off (for A/B runs).
"""

from __future__ import annotations

import functools
import os
import threading

import torch
import torch.nn.functional as F

CUBLASLT_ROWS = (17, 64)
_lock = threading.Lock()


def cublaslt_rows() -> tuple[int, int] | None:
    """The inclusive row range whose GEMMs run through cublasLt (env LORAFLEET_CUBLASLT_ROWS), or None: off."""
    return _parse_rows(os.environ.get("LORAFLEET_CUBLASLT_ROWS"))


@functools.lru_cache(maxsize=8)
def _parse_rows(value: str | None) -> tuple[int, int] | None:
    # cached: every linear() call reads the variable (tests and A/B runs change it), but parses it once
    if value is None:
        return CUBLASLT_ROWS
    if value.strip() == "0":
        return None
    try:
        lo, hi = (int(v) for v in value.split("-"))
    except ValueError:
        raise ValueError(f"LORAFLEET_CUBLASLT_ROWS must be 'lo-hi' (e.g. '17-64') or '0', got {value!r}") from None
    return lo, hi


def takes_cublaslt(x: torch.Tensor) -> bool:
    """Whether linear() runs x's GEMM through cublasLt: a CUDA half-precision x whose rows are in range (on
    NVIDIA's CUDA: a ROCm build's "cuda" tensors have other libraries, not measured here)."""
    if not x.is_cuda or torch.version.cuda is None or x.dtype not in (torch.float16, torch.bfloat16) \
            or not x.shape[-1]:
        return False
    rows = cublaslt_rows()
    return rows is not None and rows[0] <= x.numel() // x.shape[-1] <= rows[1]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through cublasLt where takes_cublaslt(x)."""
    if not takes_cublaslt(x):
        return F.linear(x, weight, bias)
    with _lock:
        before = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            return F.linear(x, weight, bias)
        finally:
            torch.backends.cuda.preferred_blas_library(before)
