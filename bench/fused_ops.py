"""Fused pointwise kernels (replicas/kernels/fused.py) against their torch references, Llama-3-8B shapes (GPU).

For each op and T in 1, 32, 64, 256 tokens: check the fused kernel against
the torch code it replaces, then time both captured in CUDA graphs
(triton.testing.do_bench_cudagraph, median), as a decode step replays them.
  torch  -- the layer's forward_native (RMSNorm, RotaryEmbedding, SiluAndMul)
            or the two index_copy_ of triton_attention (KV cache write)
  fused  -- the one Triton launch of replicas.kernels.fused
  roof   -- bytes read + written over the copy bandwidth measured in this run
Prints a table, then what one decode step (32 layers: 2 norms, rotary,
SiLU-and-mul, KV write each) spends on these ops; writes CSV to $OUT (or
bench/out).

    python bench/fused_ops.py [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

import torch
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from replicas.kernels import fused  # noqa: E402
from replicas.kernels import rotary as rope_kernel  # noqa: E402
from replicas.layers import RMSNorm, RotaryEmbedding, SiluAndMul  # noqa: E402
from replicas.model_config import RopeScaling  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS = 4096, 32, 8, 128, 14336, 32
TOKENS = (1, 32, 64, 256)
NUM_BLOCKS, BLOCK_SIZE = 2048, 16
PER_LAYER = {"add_rms_norm": 2, "rotary": 1, "silu_and_mul": 1, "write_kv": 1}
LLAMA3 = RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=8192)


def copy_bandwidth() -> float:
    """Bytes read + written per second for a 1 GiB device-to-device copy."""
    src = torch.empty(1 << 29, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=50, return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def cases(tokens: int, dtype: torch.dtype):
    """(name, torch fn, fused fn, bytes moved); each fn returns the tensors to compare."""
    size = torch.empty((), dtype=dtype).element_size()
    norm = RMSNorm(HIDDEN, 1e-5, dtype).cuda()
    norm.weight.copy_(torch.randn(HIDDEN, device="cuda") * 0.1 + 1)
    x, r = (torch.randn(tokens, HIDDEN, device="cuda", dtype=dtype) for _ in range(2))
    yield ("add_rms_norm", lambda: norm.forward_native(x, r), lambda: fused.fused_add_rms_norm(x, r, norm.weight, 1e-5),
           (4 * tokens + 1) * HIDDEN * size)

    rope = RotaryEmbedding(HEAD_DIM, 500000.0, LLAMA3).cuda()
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    qkv = torch.randn(tokens, q_size + 2 * kv_size, device="cuda", dtype=dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    positions = torch.randint(0, 8192, (tokens,), device="cuda")
    yield ("rotary", lambda: rope.forward_native(positions, q, k),
           lambda: rope_kernel.rotary(positions, q, k, rope.inv_freq, HEAD_DIM), 2 * tokens * (q_size + kv_size) * size)

    gate_up = torch.randn(tokens, 2 * INTER, device="cuda", dtype=dtype)
    act = SiluAndMul()
    yield ("silu_and_mul", lambda: act.forward_native(gate_up), lambda: fused.silu_and_mul(gate_up),
           3 * tokens * INTER * size)

    shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    caches = [torch.zeros(shape, device="cuda", dtype=dtype) for _ in range(4)]
    kh, vh = k.view(tokens, KV_HEADS, HEAD_DIM), v.view(tokens, KV_HEADS, HEAD_DIM)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, device="cuda")[:tokens]

    def index_copy():
        caches[0].view(-1, KV_HEADS, HEAD_DIM).index_copy_(0, slots, kh)
        caches[1].view(-1, KV_HEADS, HEAD_DIM).index_copy_(0, slots, vh)
        return caches[0], caches[1]

    def write():
        fused.write_kv_cache(kh, vh, caches[2], caches[3], slots)
        return caches[2], caches[3]

    yield "write_kv", index_copy, write, 4 * tokens * kv_size * size


def check(ref, out) -> float:
    """Raises if out is not close to ref; returns the fraction of bitwise-equal elements."""
    ref, out = (ref,) if torch.is_tensor(ref) else ref, (out,) if torch.is_tensor(out) else out
    equal, total, eps = 0, 0, torch.finfo(ref[0].dtype).eps
    for a, b in zip(ref, out, strict=True):
        torch.testing.assert_close(b, a, rtol=2 * eps, atol=8 * eps)  # as tests/replicas/test_fused_kernels.py
        equal, total = equal + (a == b).sum().item(), total + a.numel()
    return equal / total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/fused_ops.py times CUDA kernels and needs a GPU; on CPU run "
                 "`pytest tests/replicas/test_fused_kernels.py` instead.")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s (read+write)  {args.dtype}")
    rows, failed = [], []
    for tokens in TOKENS:
        for name, torch_fn, fused_fn, nbytes in cases(tokens, dtype):
            try:
                exact = check(torch_fn(), fused_fn())
            except AssertionError as exc:
                failed.append(f"{name} T={tokens}: {exc}")
                continue
            torch_us = do_bench_cudagraph(torch_fn, rep=50, return_mode="median") * 1e3
            fused_us = do_bench_cudagraph(fused_fn, rep=50, return_mode="median") * 1e3
            rows.append(dict(op=name, tokens=tokens, torch_us=round(torch_us, 2), fused_us=round(fused_us, 2),
                             speedup=round(torch_us / fused_us, 2), roof_us=round(nbytes / bw * 1e6, 2),
                             fused_tb_s=round(nbytes / (fused_us * 1e-6) / 1e12, 2), exact=round(exact, 4)))
    print(f"\n{'op':<14}{'T':>5}{'torch us':>10}{'fused us':>10}{'speedup':>9}{'roof us':>9}"
          f"{'fused TB/s':>12}{'bit-exact':>11}")
    for row in rows:
        print(f"{row['op']:<14}{row['tokens']:>5}{row['torch_us']:>10.2f}{row['fused_us']:>10.2f}"
              f"{row['speedup']:>8.2f}x{row['roof_us']:>9.2f}{row['fused_tb_s']:>12.2f}{row['exact']:>10.1%}")
    print(f"\nper decode step, {LAYERS} layers x (2 norms + rotary + silu_and_mul + write_kv):")
    for tokens in TOKENS:
        step = {key: sum(r[f"{key}_us"] * PER_LAYER[r["op"]] for r in rows if r["tokens"] == tokens) * LAYERS / 1e3
                for key in ("torch", "fused")}
        print(f"  T={tokens:<4} torch {step['torch']:.3f} ms  fused {step['fused']:.3f} ms  "
              f"saves {step['torch'] - step['fused']:.3f} ms")
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "out")
    os.makedirs(out_dir, exist_ok=True)
    if rows:
        with open(os.path.join(out_dir, f"fused_ops_{args.dtype}.csv"), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    if failed:
        sys.exit("correctness check failed:\n  " + "\n  ".join(failed))


if __name__ == "__main__":
    main()
