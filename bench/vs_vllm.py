"""Our punica kernels beside vLLM's Triton LoRA ops (lora_shrink + lora_expand) on bench/punica_kernels.py's sweep (GPU).

vLLM is not a dependency and none of its code lives in this repository. Point
--vllm-path at a folder from which `vllm.lora.ops.triton_ops.{lora_shrink_op,
lora_expand_op, lora_kernel_metadata}` import (a vLLM checkout, or a copy of
those files with their imports satisfied, kept out of git, e.g. under .out/).

For each layer shape x rank x T x popularity (the sweep of bench/punica_kernels.py,
the same builders and seeds):
  ours       -- PunicaWrapper.add_lora_linear (Triton backend, default config);
  vllm       -- vLLM's lora_shrink into an fp32 buffer (the op zeroes it itself
                where its version does) then lora_expand with add_inputs=True,
                on per-slice weight lists, metadata from LoRAKernelMeta, and the
                grid over max_loras + 1 adapters (vLLM's default; no
                cudagraph_specialize_lora);
  vllm spec  -- the same with num_active_loras rounded up to the captured counts
                (powers of two, max_loras + 1), as with cudagraph_specialize_lora;
  roof       -- bench/punica_kernels.py's minimum bytes over the copy bandwidth measured
                in this run.
Both are checked against the fp32 torch reference (rel err < 2e-2) and timed as
CUDA-graph replays with L2 flushed before each replay (bench/punica_kernels.py's
time_graph); a call that cannot be captured is timed eagerly, L2 flushed the
same way, and marked so. Prints a table and writes CSV to $OUT (or bench/out).

    python bench/vs_vllm.py --vllm-path .out/vllm_ref [--quick]
"""

from __future__ import annotations

import argparse
import csv
import importlib
import math
import os
import sys
import zlib
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.punica_kernels import (NUM_SLOTS, POPULARITY, RANKS, SHAPES, TOKENS, _noop,  # noqa: E402
                           copy_bandwidth, graph_of, min_bytes, time_graph)
from lora_core.mapping import LoRAMapping  # noqa: E402
from lora_core.punica import PunicaWrapper  # noqa: E402
from tests.lora_core.punica_cases import stacked_weights, token_slots  # noqa: E402

HOW_TO = """\
vLLM's LoRA Triton ops were not found (--vllm-path {path!r}).
Provide a folder from which these import (nothing of it is committed here):
    vllm.lora.ops.triton_ops.lora_shrink_op        (lora_shrink)
    vllm.lora.ops.triton_ops.lora_expand_op        (lora_expand)
    vllm.lora.ops.triton_ops.lora_kernel_metadata  (LoRAKernelMeta)
e.g. a vLLM source checkout (pass its root), or those files plus kernel_utils.py
and utils.py copied to <dir>/vllm/lora/ops/triton_ops/ with small stand-ins for
the vLLM internals they import (vllm.triton_utils, vllm.envs, vllm.platforms,
vllm.logger, vllm.utils.torch_utils, vllm.utils.math_utils); keep it under .out/."""


def load_vllm(path: str) -> SimpleNamespace:
    """Import vLLM's shrink/expand ops and metadata from path; exit 2 with instructions if absent."""
    root = os.path.abspath(path) if path else ""
    if not path or not os.path.isdir(os.path.join(root, "vllm", "lora", "ops", "triton_ops")):
        print(HOW_TO.format(path=path), file=sys.stderr)
        sys.exit(2)
    sys.path.insert(0, root)
    try:
        pkg = "vllm.lora.ops.triton_ops."
        shrink_mod = importlib.import_module(pkg + "lora_shrink_op")
        expand_mod = importlib.import_module(pkg + "lora_expand_op")
        meta_mod = importlib.import_module(pkg + "lora_kernel_metadata")
        utils_mod = importlib.import_module(pkg + "utils")
    except ImportError as exc:
        print(f"{HOW_TO.format(path=path)}\n\nimport failed: {exc!r}", file=sys.stderr)
        sys.exit(2)
    return SimpleNamespace(shrink=shrink_mod.lora_shrink, expand=expand_mod.lora_expand,
                           Meta=meta_mod.LoRAKernelMeta, utils=utils_mod,
                           files=[m.__file__ for m in (shrink_mod, expand_mod, meta_mod, utils_mod)])


def captured_count(active: int, max_loras: int) -> int:
    """num_active_loras under cudagraph_specialize_lora: the smallest captured count >= active."""
    counts = sorted({1 << i for i in range(max_loras.bit_length()) if 1 << i <= max_loras} | {max_loras + 1})
    return next(c for c in counts if c >= active)


class VllmLoRA:
    """vLLM's shrink + expand for one layer, on our stacked weights converted to their per-slice lists."""

    def __init__(self, vllm: SimpleNamespace, a: torch.Tensor, b: torch.Tensor, slices: tuple[int, ...],
                 slots: list[int], num_tokens: int, num_active: int | None = None) -> None:
        self.vllm = vllm
        num_slices, num_slots, rank, _ = a.shape
        # Ours: A [slices, slots, r, H], B [slots, sum(n), r]; theirs: one [slots, r, H] / [slots, n_k, r] per slice.
        self.lora_a = [a[k] for k in range(num_slices)]  # contiguous views
        offsets = [0]
        for n in slices:
            offsets.append(offsets[-1] + n)
        self.lora_b = [b[:, offsets[k]:offsets[k + 1], :].contiguous() for k in range(num_slices)]
        self.meta = vllm.Meta.make(num_slots, num_tokens, a.device)
        self.meta.prepare_tensors(torch.tensor(slots, dtype=torch.int32, device=a.device))
        self.num_tokens = num_tokens
        self.num_active = torch.tensor([num_active or num_slots + 1], dtype=torch.int32)  # CPU, as in vLLM
        self.buf = torch.zeros(num_slices, num_tokens, rank, dtype=torch.float32, device=a.device)

    def __call__(self, y: torch.Tensor, x: torch.Tensor, scale: float = 1.0) -> None:
        args = self.meta.meta_args(self.num_tokens)
        self.vllm.shrink(x, self.lora_a, self.buf, *args, self.num_active, scale)
        self.vllm.expand(self.buf, self.lora_b, y, *args, self.num_active, offset_start=0, add_inputs=True)

    def release(self) -> None:
        """vLLM caches pointer tables by data_ptr; drop them so a later case's tensors never hit a stale entry."""
        self.vllm.utils._LORA_A_PTR_DICT.clear()
        self.vllm.utils._LORA_B_PTR_DICT.clear()


def build_case(shape: str, rank: int, num_tokens: int, popularity: str, dtype, device, num_slots: int = NUM_SLOTS,
               hidden_slices: tuple[int, tuple[int, ...]] | None = None):
    hidden, slices = hidden_slices or SHAPES[shape]
    g = torch.Generator().manual_seed(zlib.crc32(repr((shape, rank, num_tokens, popularity)).encode()))
    a, b, ranks = stacked_weights(num_slots, rank, hidden, slices, [rank], dtype, device, g)
    slots = token_slots(num_tokens, num_slots, popularity, g)
    x = torch.randn(num_tokens, hidden, generator=g).to(device, dtype)
    y = torch.randn(num_tokens, sum(slices), generator=g).to(device, dtype)
    return SimpleNamespace(hidden=hidden, slices=slices, a=a, b=b, ranks=ranks, slots=slots, x=x, y=y)


def reference(case, num_tokens: int, num_slots: int, device) -> torch.Tensor:
    """y + LoRA(x) in fp32 through our torch backend."""
    ids = list(range(1, num_slots + 1))
    ref = PunicaWrapper(num_tokens, num_slots, device, backend="torch")
    ref.update_metadata(LoRAMapping([ids[s] for s in case.slots], [ids[case.slots[0]]], num_tokens > 1), ids)
    want = case.y.float()
    ref.add_lora_linear(want, case.x.float(), case.a.float(), case.b.float(), None, 1.0, case.slices, case.ranks)
    return want


def ours_op(case, num_tokens: int, num_slots: int, device):
    ids = list(range(1, num_slots + 1))
    ours = PunicaWrapper(num_tokens, num_slots, device, backend="triton")
    ours.update_metadata(LoRAMapping([ids[s] for s in case.slots], [ids[case.slots[0]]], num_tokens > 1), ids)
    return lambda y, x: ours.add_lora_linear(y, x, case.a, case.b, None, 1.0, case.slices, case.ranks)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).abs().max() / want.abs().max()).item()


def time_op(fn) -> tuple[float, str]:
    """CUDA-graph replay time with L2 flushed; eager (L2 flushed by do_bench) if capture fails."""
    try:
        graph = graph_of(fn)
    except Exception as exc:  # noqa: BLE001 -- report, then fall back
        print(f"  capture failed ({type(exc).__name__}: {exc}); timing eagerly", flush=True)
        torch.cuda.synchronize()
        from triton.testing import do_bench
        return 1e3 * do_bench(fn, warmup=20, rep=200, return_mode="median"), "eager"
    us = time_graph(graph)
    del graph
    return us, "graph"


def run_case(vllm, shape: str, rank: int, num_tokens: int, popularity: str, dtype, bw: float) -> dict:
    device = "cuda"
    case = build_case(shape, rank, num_tokens, popularity, dtype, device)
    want = reference(case, num_tokens, NUM_SLOTS, device)
    adapters = len(set(case.slots))
    ours = ours_op(case, num_tokens, NUM_SLOTS, device)
    theirs = VllmLoRA(vllm, case.a, case.b, case.slices, case.slots, num_tokens)
    spec = VllmLoRA(vllm, case.a, case.b, case.slices, case.slots, num_tokens, captured_count(adapters, NUM_SLOTS))

    errs = {}
    for name, fn in (("ours", ours), ("vllm", theirs), ("spec", spec)):
        got = case.y.clone()
        fn(got, case.x)
        errs[name] = rel_err(got, want)

    y = case.y.clone()
    ours_us, ours_mode = time_op(lambda: ours(y, case.x))
    vllm_us, vllm_mode = time_op(lambda: theirs(y, case.x))
    spec_us, spec_mode = time_op(lambda: spec(y, case.x))
    theirs.release()
    roof_us = 1e6 * min_bytes(num_tokens, case.hidden, case.slices, rank, adapters, case.x.element_size()) / bw
    modes = {ours_mode, vllm_mode, spec_mode}
    return dict(shape=shape, rank=rank, T=num_tokens, popularity=popularity, adapters=adapters,
                ours_us=ours_us, vllm_us=vllm_us, vllm_spec_us=spec_us, roof_us=roof_us,
                ours_bw=roof_us / ours_us, vllm_bw=roof_us / vllm_us,
                speedup=vllm_us / ours_us, speedup_spec=spec_us / ours_us,
                ours_err=errs["ours"], vllm_err=errs["vllm"], vllm_spec_err=errs["spec"],
                timing="graph" if modes == {"graph"} else "+".join(f"{n}:{m}" for n, m in
                                                                  (("ours", ours_mode), ("vllm", vllm_mode),
                                                                   ("spec", spec_mode)) if m != "graph"))


HEADER = (f"{'shape':8}{'r':>4}{'T':>6} {'popularity':10}{'#ad':>4}{'ours us':>10}{'vllm us':>10}{'spec us':>10}"
          f"{'roof us':>9}{'ours%bw':>8}{'vllm%bw':>8}{'vllm/ours':>10}{'spec/ours':>10}{'err ours':>9}"
          f"{'err vllm':>9}  timing")


def print_row(r: dict) -> None:
    print(f"{r['shape']:8}{r['rank']:>4}{r['T']:>6} {r['popularity']:10}{r['adapters']:>4}{r['ours_us']:>10.2f}"
          f"{r['vllm_us']:>10.2f}{r['vllm_spec_us']:>10.2f}{r['roof_us']:>9.2f}{100 * r['ours_bw']:>7.0f}%"
          f"{100 * r['vllm_bw']:>7.0f}%{r['speedup']:>10.2f}{r['speedup_spec']:>10.2f}{r['ours_err']:>9.1e}"
          f"{max(r['vllm_err'], r['vllm_spec_err']):>9.1e}  {r['timing']}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vllm-path", default=None, help="folder that makes vLLM's LoRA Triton ops importable")
    parser.add_argument("--quick", action="store_true", help="T in 1, 64, 1024 only")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = parser.parse_args()
    vllm = load_vllm(args.vllm_path)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    bw = copy_bandwidth()
    flag = torch.zeros(1, device="cuda")
    floor_us = time_graph(graph_of(lambda: _noop[(1,)](flag)))
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  copy bandwidth {bw / 1e12:.2f} TB/s "
          f"(read+write)  one-kernel graph floor {floor_us:.2f} us  dtype {args.dtype}")
    print("vllm ops from " + ", ".join(os.path.relpath(f) for f in vllm.files))
    tokens = (1, 64, 1024) if args.quick else TOKENS
    rows = []
    print(HEADER)
    for shape in SHAPES:
        for rank in RANKS:
            for t in tokens:
                for pop in POPULARITY:
                    rows.append(run_case(vllm, shape, rank, t, pop, dtype, bw))
                    print_row(rows[-1])
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "out")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"vs_vllm_{args.dtype}.csv")
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    speedups = [r["speedup"] for r in rows]
    spec_speedups = [r["speedup_spec"] for r in rows]
    geo = math.exp(sum(map(math.log, speedups)) / len(speedups))
    geo_spec = math.exp(sum(map(math.log, spec_speedups)) / len(spec_speedups))
    worst = max(max(r["ours_err"], r["vllm_err"], r["vllm_spec_err"]) for r in rows)
    print(f"\ngeomean vllm/ours {geo:.2f} (spec {geo_spec:.2f}); ours faster in {sum(s > 1 for s in speedups)} "
          f"of {len(rows)} cases (vs spec: {sum(s > 1 for s in spec_speedups)}); max rel err {worst:.2e}; "
          f"one-kernel floor {floor_us:.2f} us; CSV {path}")
    if not math.isfinite(worst) or worst > 2e-2:
        sys.exit("correctness check failed")


if __name__ == "__main__":
    main()
