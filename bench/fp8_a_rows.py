"""What refreshing one slot's FP8 A rows costs (replicas/fp8_lora.py; CUDA only): a launch per linear module
against kernels.fp8.QuantizeTables' one launch, on Llama-3-8B's 128 linear LoRA modules, per adapter slot write.

    python bench/fp8_a_rows.py --ranks 16 64

Host: microseconds per slot write enqueued while a sleep kernel holds the GPU (so no call waits for it), p50.
GPU: microseconds per slot write between events, p50. Each line's ratio is the per-module form over the one launch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from replicas.kernels.fp8 import QuantizeTables  # noqa: E402
from replicas.quantization import FP8, quantize_rows_into  # noqa: E402

LAYERS = 32
MODULES = ((4096, 3), (4096, 1), (4096, 2), (14336, 1))  # qkv, o, gate_up, down: (in features, slices)
HOLD_CYCLES = 50_000_000


def parts_for(rank: int, slots: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    parts = []
    for _ in range(LAYERS):
        for width, slices in MODULES:
            rows = slices * rank
            parts.append((torch.randn(slots, rows, width, dtype=torch.bfloat16, device="cuda") * 0.02,
                          torch.empty(slots, rows, width, dtype=FP8, device="cuda"),
                          torch.empty(slots, rows, device="cuda")))
    return parts


def timed(fn, calls: int, repeats: int) -> tuple[float, float]:
    """(host us, GPU us) per call, p50 over repeats."""
    for _ in range(3):
        fn()
    host, gpu = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda._sleep(HOLD_CYCLES)
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        host.append((time.perf_counter() - t) / calls * 1e6)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end) / calls * 1e3)
    return statistics.median(host), statistics.median(gpu)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--repeats", type=int, default=10)
    a = p.parse_args()
    print(f"{torch.cuda.get_device_name()}: one slot's A rows, {LAYERS * len(MODULES)} modules; us per slot write, "
          f"p50 of {a.repeats} x {a.calls}")
    print(f"{'rank':>4} {'form':14} {'host us':>9} {'GPU us':>9}")
    for rank in a.ranks:
        parts = parts_for(rank, a.slots)
        tables = QuantizeTables(parts)

        def per_module(slot: int = 5) -> None:
            for src, dst, scales in parts:
                quantize_rows_into(src[slot], dst[slot], scales[slot])

        looped, one = timed(per_module, a.calls, a.repeats), timed(lambda: tables(5), a.calls, a.repeats)
        check = [(d[5].clone(), s[5].clone()) for _, d, s in parts]
        per_module()
        same = all(torch.equal(d[5].view(torch.uint8), c[0].view(torch.uint8)) and torch.equal(s[5], c[1])
                   for (_, d, s), c in zip(parts, check))
        print(f"{rank:>4} {'per module':14} {looped[0]:9.1f} {looped[1]:9.1f}")
        print(f"{rank:>4} {'one launch':14} {one[0]:9.1f} {one[1]:9.1f}   per module / one launch: host "
              f"{looped[0] / one[0]:.1f} x, GPU {looped[1] / one[1]:.2f} x; same rows and scales: {same}")


if __name__ == "__main__":
    main()
