"""Punica kernel benchmark on Llama-3-8B shapes (GPU).

For each layer shape x rank x T x popularity: check our Triton shrink+expand
against the torch reference, then time
  ours   -- add_lora_linear captured in a CUDA graph, replayed with L2 flushed
            between replays (decode reads cold adapter weights);
  torch  -- the plain-torch reference, eager (it reads slots back to the host,
            so it cannot be captured), L2 flushed the same way;
  roof   -- minimum bytes (distinct adapters' A and B at their rank, x, y read
            and written) over the device-to-device copy bandwidth measured in
            this run;
  floor  -- a one-kernel CUDA graph replayed the same way (launch floor).
Prints a table with ratios and writes CSV to $OUT (or bench/out).

    python bench/punica_kernels.py [--quick]
    python bench/punica_kernels.py --sweep-tokens 1 16               # the main sweep at these T only
    python bench/punica_kernels.py --deal 0,0,0 --deal 256,512,256   # SGMV dealing settings side by side
    python bench/punica_kernels.py --bgmv-tile 0 8192 16384 --tokens 1 16   # BGMV shrink tiles side by side
    python bench/punica_kernels.py --bgmv-splits 64 32 16 --tokens 1 16     # BGMV shrink split limits side by side
    python bench/punica_kernels.py --bgmv-rows-per-adapter 2 16 --tokens 4 8 16 32 --pops identical uniform   # BGMV or SGMV
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from lora_core.mapping import LoRAMapping  # noqa: E402
from lora_core.punica import PunicaWrapper  # noqa: E402
from tests.lora_core.punica_cases import stacked_weights, token_slots  # noqa: E402

SHAPES = {  # name: (in features, output slices)
    "qkv": (4096, (4096, 1024, 1024)),
    "gate_up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
}
TOKENS = (1, 16, 64, 256, 1024, 4096)
RANKS = (16, 64)
POPULARITY = ("identical", "uniform", "distinct")
NUM_SLOTS = 64


def copy_bandwidth() -> float:
    """Bytes read + written per second for a 1 GiB device-to-device copy."""
    src = torch.empty(1 << 29, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=50, return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


@triton.jit
def _noop(ptr):
    tl.store(ptr, 1.0)


def graph_of(fn) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def time_graph(graph: torch.cuda.CUDAGraph) -> float:
    """Median microseconds per replay; do_bench clears L2 before each replay."""
    return 1e3 * do_bench(graph.replay, warmup=20, rep=200, return_mode="median")


def min_bytes(num_tokens: int, hidden: int, slices: tuple[int, ...], rank: int, adapters: int, esize: int) -> int:
    weights = adapters * rank * (hidden * len(slices) + sum(slices))
    return esize * (weights + num_tokens * hidden + 2 * num_tokens * sum(slices))


def run_case(shape: str, rank: int, num_tokens: int, popularity: str, dtype, bw: float, floor_us: float,
             bgmv_max_tokens: int = 32, adapter_rank: int | None = None, use_pdl: bool | None = None,
             time_torch: bool = True):
    """One case; adapter_rank < rank puts lower-rank adapters in slots sized for rank."""
    hidden, slices = SHAPES[shape]
    adapter_rank = adapter_rank or rank
    g = torch.Generator().manual_seed(hash((shape, rank, num_tokens, popularity)) % 2**31)
    a, b, ranks = stacked_weights(NUM_SLOTS, rank, hidden, slices, [adapter_rank], dtype, "cuda", g)
    slots = token_slots(num_tokens, NUM_SLOTS, popularity, g)
    ids = list(range(1, NUM_SLOTS + 1))
    mapping = LoRAMapping([ids[s] for s in slots], [ids[slots[0]]], num_tokens > 1)
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=dtype)
    y = torch.randn(num_tokens, sum(slices), device="cuda", dtype=dtype)
    ours = PunicaWrapper(num_tokens, NUM_SLOTS, "cuda", backend="triton", bgmv_max_tokens=bgmv_max_tokens,
                         use_pdl=use_pdl)
    ref = PunicaWrapper(num_tokens, NUM_SLOTS, "cuda", backend="torch")
    for w in (ours, ref):
        w.update_metadata(mapping, ids)

    got, want = y.clone(), y.float()
    ours.add_lora_linear(got, x, a, b, None, 1.0, slices, ranks)
    ref.add_lora_linear(want, x.float(), a.float(), b.float(), None, 1.0, slices, ranks)
    err = ((got.float() - want).abs().max() / want.abs().max()).item()

    graph = graph_of(lambda: ours.add_lora_linear(y, x, a, b, None, 1.0, slices, ranks))
    ours_us = time_graph(graph)
    torch_us = float("nan") if not time_torch else 1e3 * do_bench(
        lambda: ref.add_lora_linear(y, x, a, b, None, 1.0, slices, ranks), warmup=3, rep=30, return_mode="median")
    adapters = len(set(slots))
    roof_us = 1e6 * min_bytes(num_tokens, hidden, slices, adapter_rank, adapters, x.element_size()) / bw
    del graph
    path = ("bgmv" if ours.token_meta.use_bgmv else "sgmv") + ("+pdl" if ours.use_pdl else "")
    return dict(shape=shape, rank=rank, T=num_tokens, popularity=popularity, adapters=adapters, path=path,
                ours_us=ours_us, torch_us=torch_us, roof_us=roof_us, floor_us=floor_us,
                bw_frac=roof_us / ours_us, vs_torch=torch_us / ours_us, vs_floor=ours_us / floor_us,
                rel_err=err)


def print_row(r: dict) -> None:
    print(f"{r['shape']:8}{r['rank']:>4}{r['T']:>6} {r['popularity']:10}{r['adapters']:>4} {r['path']:9}"
          f"{r['ours_us']:>10.2f}{r['torch_us']:>10.1f}{r['roof_us']:>9.2f}{100 * r['bw_frac']:>5.0f}%"
          f"{r['vs_torch']:>8.1f}{r['vs_floor']:>8.2f}{r['rel_err']:>9.1e}", flush=True)


def sweep_settings(args, dtype, bw: float, floor_us: float, settings: list, label, apply) -> None:
    """Our default path per case under each of `settings` (apply(setting) puts it in place), side by side,
    with ratios to the first and the best over the graph floor."""
    print(f"{'shape':8}{'r':>4}{'T':>6} {'popularity':10}" + "".join(f"{label(v):>16}" for v in settings)
          + "".join(f"{'x first':>9}" for _ in settings[1:]) + f"{'best x floor':>14}")
    for shape in SHAPES:
        for rank in args.ranks:
            for t in args.tokens:
                for pop in args.pops:
                    times = []
                    for setting in settings:
                        apply(setting)
                        times.append(run_case(shape, rank, t, pop, dtype, bw, floor_us, time_torch=False)["ours_us"])
                    print(f"{shape:8}{rank:>4}{t:>6} {pop:10}" + "".join(f"{v:>16.2f}" for v in times)
                          + "".join(f"{v / times[0]:>9.2f}" for v in times[1:]) + f"{min(times) / floor_us:>14.2f}",
                          flush=True)


def sweep_dealing(args, dtype, bw: float, floor_us: float) -> None:
    """--deal: triton_ops' SHRINK,EXPAND,SPLIT_ROWS programs (0,0,0 deals nothing: the host plan alone)."""
    from lora_core.punica import triton_ops

    def apply(deal):
        triton_ops.DEAL_SHRINK_PROGRAMS, triton_ops.DEAL_EXPAND_PROGRAMS, triton_ops.SPLIT_ROWS = deal
    deals = [tuple(int(v) for v in d.split(",")) for d in args.deal]
    sweep_settings(args, dtype, bw, floor_us, deals, lambda d: "/".join(map(str, d)), apply)


# --flag: (the module and knob it sweeps side by side, its help). Each knob is a host-side plan setting of the
# punica launches, so a sweep swaps it between cases of one process.
BGMV_SWEEPS = {
    "bgmv_tile": ("triton_ops", "BGMV_SHRINK_TILE",
                  "BGMV shrink tile limits (0: one K step of the rank's default width)"),
    "bgmv_splits": ("triton_ops", "BGMV_MAX_SPLITS",
                    "BGMV shrink split limits (fewer: longer shrink programs, fewer partials)"),
    "bgmv_partials": ("triton_ops", "BGMV_SPLIT_PARTIALS", "BGMV split partials per row, rank x splits (0: no cap)"),
    "bgmv_min_programs": ("triton_ops", "BGMV_MIN_PROGRAMS",
                          "programs a capped BGMV shrink keeps, up to one K step each"),
    "rank_mask_group": ("triton_ops", "RANK_MASK_GROUP", "ranks an expand's rank mask covers at a time (1: exact)"),
    "bgmv_rows_per_adapter": ("metadata", "BGMV_ROWS_PER_ADAPTER",
                              "rows per adapter up to which steps of <= 32 rows run BGMV instead of SGMV"),
}


def sweep_bgmv(args, dtype, bw: float, floor_us: float) -> bool:
    """The first --bgmv-* flag given, side by side; False when none was."""
    import importlib

    for flag, (module, knob, _) in BGMV_SWEEPS.items():
        if getattr(args, flag):
            where = importlib.import_module(f"lora_core.punica.{module}")
            print(f"one-kernel graph floor {floor_us:.2f} us; {module}.{knob}")
            sweep_settings(args, dtype, bw, floor_us, getattr(args, flag), str,
                           lambda value, where=where, knob=knob: setattr(where, knob, value))
            return True
    return False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a few cases only")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--deal", action="append", default=[], metavar="SHRINK,EXPAND,SPLIT_ROWS",
                        help="sweep the SGMV dealing settings of triton_ops instead (repeat; 0,0,0 = off)")
    for flag, (module, knob, text) in BGMV_SWEEPS.items():
        parser.add_argument("--" + flag.replace("_", "-"), type=int, nargs="+", default=[],
                            help=f"{text}, side by side ({module}.{knob})")
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 32, 64, 256], help="with --deal, --bgmv-*")
    parser.add_argument("--ranks", type=int, nargs="+", default=list(RANKS), help="with --deal, --bgmv-*")
    parser.add_argument("--pops", nargs="+", default=list(POPULARITY), help="with --deal, --bgmv-*")
    parser.add_argument("--sweep-tokens", type=int, nargs="+", metavar="T",
                        help="the main sweep at these T only (default: all of TOKENS; --quick: 1, 64, 1024)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    bw = copy_bandwidth()
    flag = torch.zeros(1, device="cuda")
    floor_us = time_graph(graph_of(lambda: _noop[(1,)](flag)))
    if args.deal:
        sweep_dealing(args, dtype, bw, floor_us)
        return
    if sweep_bgmv(args, dtype, bw, floor_us):
        return
    floor2_us = time_graph(graph_of(lambda: (_noop[(1,)](flag), _noop[(1,)](flag))))
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s (read+write)  "
          f"one-kernel graph floor {floor_us:.2f} us  (two kernels: {floor2_us:.2f} us)  dtype {args.dtype}")
    tokens = args.sweep_tokens or ((1, 64, 1024) if args.quick else TOKENS)
    rows = []
    header = (f"{'shape':8}{'r':>4}{'T':>6} {'popularity':10}{'#ad':>4} {'path':9}{'ours us':>10}{'torch us':>10}"
              f"{'roof us':>9}{'%bw':>6}{'x torch':>8}{'x floor':>8}{'relerr':>9}")
    print(header)
    for shape in SHAPES:
        for rank in RANKS:
            for t in tokens:
                for pop in POPULARITY:
                    # Small steps run BGMV by default; time the SGMV tiles beside them.
                    for bgmv_max in ((32, 0) if t <= 64 else (32,)):
                        rows.append(run_case(shape, rank, t, pop, dtype, bw, floor_us, bgmv_max))
                        print_row(rows[-1])
                    if t <= 16:  # the same default path without programmatic dependent launch
                        rows.append(run_case(shape, rank, t, pop, dtype, bw, floor_us, use_pdl=False))
                        print_row(rows[-1])
    print("\nmixed ranks: rank-8 adapters in slots sized for rank 64 (ranks table masks the padding)"
          " vs the same adapters in rank-8 slots; T = 64, distinct")
    for shape in SHAPES:
        padded = run_case(shape, 64, 64, "distinct", dtype, bw, floor_us, adapter_rank=8)
        exact = run_case(shape, 8, 64, "distinct", dtype, bw, floor_us)
        print_row(padded)
        print_row(exact)
        print(f"  {shape}: padded / exact = {padded['ours_us'] / exact['ours_us']:.2f}")
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "out")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"kernels_{args.dtype}.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    worst = max(r["rel_err"] for r in rows)
    slower = [r for r in rows if r["vs_torch"] < 1.0]
    print(f"max rel err {worst:.2e}; cases slower than torch: {len(slower)} of {len(rows)}")
    if not math.isfinite(worst) or worst > 2e-2:
        sys.exit("correctness check failed")


if __name__ == "__main__":
    main()
