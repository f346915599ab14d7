"""What the fused consumers' dependent rank load costs (GPU): bench/pending_expand.py as it is, then with
row_slot's rank read replaced by a constant, side by side.

A fused consumer of a PendingExpand (SiluAndMul, the rotary embedding, the add + RMSNorm; replicas/kernels)
loads its row's slot, then that slot's rank for its slice, then its B tile masked by the rank: two dependent
round trips before the bytes. The second run makes every rank the constant --rank (each slot of
pending_expand's cases has that rank, so the results are the same), so the B tile waits for the slot alone.
If that saves a microsecond or more per site, a per-row rank table built with the step's metadata (loaded
beside the slot, not after it) is worth building. On an H200 it saved 0.1-0.5 us per site, and ranks loaded
beside the slot as a vector ran no faster overall (bench/RESULTS.md, nineteenth session): no table.

    python bench/rank_latency.py --sites gate_up qkv o down --tokens 16 32 --adapters 1 10 32

The constant run patches row_slot in the kernels' modules before their first compile, so each run is its
own process; the remaining arguments go to pending_expand.py as they are (its --ranks must hold --rank only).
"""

from __future__ import annotations

import os
import subprocess
import sys

import triton
import triton.language as tl

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))


_RANK = None  # the constant rank, a tl.constexpr set before the first compile


def _row_slot_const(slots_ptr, ranks_ptr, row, slice_idx, sr_s):
    """row_slot (lora_core/punica/row_expand.py) without the rank load: every slot has rank _RANK."""
    slot = tl.load(slots_ptr + row)
    return tl.maximum(slot, 0).to(tl.int64), tl.where(slot >= 0, _RANK, 0)


def patch(rank: int) -> None:
    """Swap row_slot for the constant-rank one in every fused consumer's module (before they compile)."""
    global _RANK
    from replicas.kernels import fused, lora_norm, lora_rotary

    _RANK = tl.constexpr(rank)
    const = triton.jit(_row_slot_const)
    for module in (fused, lora_norm, lora_rotary):
        module.row_slot = const


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["--inner"]:
        patch(int(args[1]))
        import bench.pending_expand as pe

        sys.argv = ["pending_expand.py", *args[2:]]
        return pe.main()
    rank = 16
    if "--rank" in args:
        i = args.index("--rank")
        rank = int(args[i + 1])
        del args[i:i + 2]
    rest = [*args, "--ranks", str(rank)]
    for label, cmd in (("ranks loaded (as the engine)", [os.path.join(HERE, "pending_expand.py"), *rest]),
                       (f"rank {rank} constant", [os.path.abspath(__file__), "--inner", str(rank), *rest])):
        print(f"== {label}", flush=True)
        subprocess.run([sys.executable, *cmd], check=True)


if __name__ == "__main__":
    main()
