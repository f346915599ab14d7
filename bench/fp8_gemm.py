"""What one FP8 linear layer costs a decode step, part by part, against the bfloat16 layer it replaces.

EngineArgs.quantization="fp8" halves the bytes a decode step reads for the base weights, so its linear layers
should approach half the bfloat16 time; bench/engine.py's base+f8 row showed its decode step slower instead
(thirty-second session). This times, on Llama-3-8B's projections and a decode batch's rows, side by side:

    python bench/fp8_gemm.py --rows 1 32 64 256

  bf16      F.linear on bfloat16 weights (what the engine runs without quantization)
  fp8       replicas.quantization.fp8_linear: the Triton input quantizer, then (up to UNIT_SCALE_ROWS rows)
            torch._scaled_mm with unit scales into float32 and the Triton epilogue that applies the scales
  fp8-row   the input quantizer, then torch._scaled_mm with row-wise scales (fp8_linear's form above those rows)
  quant     the input quantizer alone
  mm-row    torch._scaled_mm with row-wise scales alone (input already quantized)
  mm-unit   torch._scaled_mm with unit scales into float32 alone
  bound     the FP8 weight's bytes over the copy bandwidth measured in the same run

each the median of CUDA-graph replays (20 calls a graph, L2 flushed before each replay: decode reads
weights cold), per call, and fp8 / bf16 and fp8 / bound.

    python bench/fp8_gemm.py --norm --rows 1 32 64

times instead the add + RMSNorm and the FP8 layer it feeds (qkv, gate_up), side by side: the norm, then
fp8_linear quantizing its input in its own launch ("norm+fp8", LORAFLEET_FP8_NORM_QUANT=0's path), and the norm
writing the layer's FP8 input as it writes its output (RMSNorm.fp8_output, the engine's default: "normq+fp8"),
with the bfloat16 layer after the norm beside them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from replicas.quantization import fp8_linear, quantize_rows  # noqa: E402

COLUMNS = ("bf16", "fp8", "fp8-row", "quant", "mm-row", "mm-unit")

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
CALLS = 20


def graph_time(fn, flush: torch.Tensor, replays: int = 20) -> float:
    """ms per call of fn, from replays of a graph holding CALLS calls, the L2 flushed before each replay."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    times = []
    for _ in range(replays):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / CALLS)
    return statistics.median(times)


def copy_bandwidth(flush: torch.Tensor) -> float:
    """bytes per second, read + written, of a large device-to-device copy."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = graph_time(lambda: dst.copy_(src), flush, replays=5)
    return 2 * src.numel() / (ms / 1e3)


def norm_rows(rows_list: list[int], flush: torch.Tensor) -> None:
    """--norm: the add + RMSNorm before qkv / gate_up with the FP8 layer after it, the input quantized in the
    layer or by the norm."""
    from replicas.kernels import fused  # triton: CUDA only

    print(f"{'layer':8} {'rows':>5} {'norm+bf16':>10} {'norm+fp8':>10} {'normq+fp8':>10} {'saved':>8} {'q/fp8':>8}")
    g = torch.Generator(device="cuda").manual_seed(0)
    for name in ("qkv", "gate_up"):
        k, n = SHAPES[name]
        w = (torch.randn(n, k, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
        wq, ws = quantize_rows(w)
        norm_w = torch.ones(k, device="cuda", dtype=torch.bfloat16)
        for rows in rows_list:
            x, r = (torch.randn(rows, k, generator=g, device="cuda").to(torch.bfloat16) for _ in range(2))

            def site(layer, quantize=False):
                y, _ = fused.fused_add_rms_norm(x, r, norm_w, 1e-5, quantize)
                return layer(y)

            t = {"bf16": graph_time(lambda: site(lambda y: F.linear(y, w)), flush),
                 "fp8": graph_time(lambda: site(lambda y: fp8_linear(y, wq, ws)), flush),
                 "fp8q": graph_time(lambda: site(lambda y: fp8_linear(y, wq, ws), True), flush)}
            print(f"{name:8} {rows:5d} {t['bf16'] * 1e3:10.1f} {t['fp8'] * 1e3:10.1f} {t['fp8q'] * 1e3:10.1f}"
                  f" {(t['fp8'] - t['fp8q']) * 1e3:8.1f} {t['fp8q'] / t['fp8']:8.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32, 64, 256])
    p.add_argument("--norm", action="store_true", help="the norm before qkv / gate_up with the FP8 layer (docstring)")
    args = p.parse_args()
    from replicas.kernels.fp8 import quantize_rows as quantize_on_gpu  # triton: CUDA only

    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    bandwidth = copy_bandwidth(flush)
    print(f"{torch.cuda.get_device_name()}  copy bandwidth {bandwidth / 1e12:.3f} TB/s  (us per call)")
    if args.norm:
        norm_rows(args.rows, flush)
        return
    print(f"{'layer':8} {'rows':>5} " + " ".join(f"{c:>8}" for c in COLUMNS)
          + f" {'bound':>8} {'fp8/bf16':>8} {'row/bf16':>8} {'fp8/bnd':>8}")
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (k, n) in SHAPES.items():
        w = (torch.randn(n, k, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
        wq, ws = quantize_rows(w)
        one = torch.ones((), device="cuda")
        for rows in args.rows:
            x = torch.randn(rows, k, generator=g, device="cuda").to(torch.bfloat16)
            xq, xs = quantize_rows(x)
            def row_wise(xq, xs):
                return torch._scaled_mm(xq, wq.t(), scale_a=xs.unsqueeze(1), scale_b=ws.unsqueeze(0),
                                        out_dtype=torch.bfloat16)

            t = {
                "bf16": graph_time(lambda: F.linear(x, w), flush),
                "fp8": graph_time(lambda: fp8_linear(x, wq, ws), flush),
                "fp8-row": graph_time(lambda: row_wise(*quantize_on_gpu(x)), flush),
                "quant": graph_time(lambda: quantize_on_gpu(x), flush),
                "mm-row": graph_time(lambda: row_wise(xq, xs), flush),
                "mm-unit": graph_time(lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one,
                                                               out_dtype=torch.float32), flush),
            }
            bound = wq.numel() / bandwidth * 1e3  # ms to read the FP8 weight once
            print(f"{name:8} {rows:5d} " + " ".join(f"{t[c] * 1e3:8.1f}" for c in COLUMNS)
                  + f" {bound * 1e3:8.1f} {t['fp8'] / t['bf16']:8.2f} {t['fp8-row'] / t['bf16']:8.2f}"
                  f" {t['fp8'] / bound:8.2f}")


if __name__ == "__main__":
    main()
