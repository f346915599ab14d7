"""The stacked step's expand alone, per site and adapter count, under several launch shapes.

After the shrink moved into the base GEMM (lora_core/stacked_a.py) the expand is a LoRA site's whole kernel
cost. The 8B decode profile (RESULTS.md, ninth session) has gate_up's SGMV expand at 12.9 us for 32 rows
over 10 adapters, ~6x its bytes. This times `PunicaWrapper.add_expand_stacked` (the engine's rule) against
forced BGMV, SGMV with other B columns per program, and a dense reference (one-hot masked shrink @ every
slot's B, cuBLAS), each a CUDA-graph replay with L2 flushed.

    python bench/stacked_expand.py --tokens 32 --adapters 1 4 10 27

Columns: engine (the current rule), tiles (the rule with column_expand.py off), bgmv / sgmv (the launch shape
before stacked_expand_config, forced to one kernel), {sgmv,bgmv}NxK (programs of K tiles of N columns), colNxS[xG]
(column_expand.py with N-column tiles, S pipeline stages, G slots per program, default all; --columns), dense
(with --dense). --compact puts the adapters in the slots below their bound, as the engine's compaction keeps them.

    python bench/stacked_expand.py --compact --no-shapes --tokens 16 32 64 --adapters 1 4 12 16 32 --ranks 16 64
"""

from __future__ import annotations

import argparse
import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.punica_kernels import graph_of, time_graph  # noqa: E402
from bench.lora_site import SITES, SLOTS  # noqa: E402
from lora_core.mapping import LoRAMapping  # noqa: E402
from lora_core.punica import PunicaWrapper, triton_ops  # noqa: E402
from lora_core.punica.metadata import adapter_bound  # noqa: E402
from lora_core.punica.column_expand import column_expand  # noqa: E402
from tests.lora_core.punica_cases import stacked_weights  # noqa: E402


# (BLOCK_N, B tiles per program) launch shapes tried beside the engine's own
VARIANTS = ((64, 1), (128, 1), (128, 2), (256, 1), (256, 2))


def slots_for(tokens: int, adapters: int, g: torch.Generator, compact: bool = False) -> list[int]:
    """adapters distinct slots spread over all SLOTS (as a Zipf step's are without slot compaction), cycled over
    the rows; compact: spread over the slots below adapter_bound(adapters), as the engine's compaction keeps them."""
    top = adapter_bound(adapters, SLOTS) if compact else SLOTS
    chosen = torch.randperm(top, generator=g)[:adapters].tolist()
    chosen[0] = top - 1  # the highest slot in use sets the bound, as a long-running adapter does
    return [chosen[i % adapters] for i in range(tokens)]


def run(site: str, tokens: int, adapters: int, rank: int, dense_too: bool = False, shapes: bool = True,
        columns: tuple[tuple[int, ...], ...] = (), compact: bool = False) -> dict[str, float]:
    g = torch.Generator().manual_seed(tokens * 7 + adapters)
    hidden, slices = SITES[site]
    _, b, ranks = stacked_weights(SLOTS, rank, hidden, slices, [rank], torch.bfloat16, "cuda", g)
    slots = slots_for(tokens, adapters, g, compact)
    ids = list(range(1, SLOTS + 1))
    wrapper = PunicaWrapper(max(tokens, 16), SLOTS, "cuda", backend="triton", stacked_max_tokens=tokens)
    wrapper.update_metadata(LoRAMapping([ids[s] for s in slots], [ids[slots[0]]], False), ids)
    bound = wrapper.stacked_rows()
    per_slot = len(slices) * rank
    shrunk = torch.randn(tokens, bound * per_slot, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(tokens, sum(slices), device="cuda", dtype=torch.bfloat16)

    def engine():
        wrapper.add_expand_stacked(y, shrunk, b, slices, ranks)

    def forced(bgmv: bool, n_blocks: int | None = None, block_n: int = 128):
        """BGMV or SGMV; with n_blocks, programs of n_blocks B tiles of block_n columns, else the launch
        shape before stacked_expand_config (expand_config's)."""
        real_expand = triton_ops.expand

        def expand(*args, **kwargs):
            return real_expand(*args, **{**kwargs, "one_tile": n_blocks is not None})

        def shape(rank):
            return block_n, block_n * (n_blocks or 1)

        def fn():
            with mock.patch.object(triton_ops, "use_bgmv_stacked", lambda *a: bgmv), \
                    mock.patch.object(triton_ops, "expand", expand), \
                    mock.patch.object(triton_ops, "stacked_expand_config", shape):
                wrapper.add_expand_stacked(y, shrunk, b, slices, ranks)
        return fn

    # Dense reference: every slot's B as one [bound*R, N] matrix per slice, the shrink masked to the row's slot.
    b_dense = [b[:bound, off:off + n, :].permute(0, 2, 1).reshape(bound * rank, n).contiguous()
               for off, n in zip([sum(slices[:i]) for i in range(len(slices))], slices)]
    onehot = torch.zeros(tokens, bound, 1, 1, device="cuda", dtype=torch.bfloat16)
    onehot[torch.arange(tokens), torch.tensor(slots)] = 1

    def dense():
        masked = (shrunk.view(tokens, bound, len(slices), rank) * onehot).transpose(1, 2)
        off = 0
        for s, n in enumerate(slices):
            y[:, off:off + n].addmm_(masked[:, s].reshape(tokens, bound * rank), b_dense[s])
            off += n

    def column(block_n: int, stages: int, group: int = 0):
        offsets = wrapper._offsets(slices)

        def fn():
            column_expand(y, shrunk, b, offsets, max(slices), len(slices), wrapper.token_meta.slots, tokens,
                          bound, use_pdl=wrapper.use_pdl, config=(block_n, stages, group))
        return fn

    def tiles():  # the engine's expand before column_expand.py: one B tile of one adapter per program
        with mock.patch.dict(os.environ, {"LORAFLEET_COLUMN_EXPAND": "0"}):
            wrapper.add_expand_stacked(y, shrunk, b, slices, ranks)

    cases = {"engine": engine, "tiles": tiles}
    if shapes:
        cases |= {"bgmv": forced(True), "sgmv": forced(False)}
        for block_n, n_blocks in VARIANTS:
            cases[f"sgmv{block_n}x{n_blocks}"] = forced(False, n_blocks, block_n)
            cases[f"bgmv{block_n}x{n_blocks}"] = forced(True, n_blocks, block_n)
    for shape in columns:
        cases["col" + "x".join(map(str, shape))] = column(*shape)
    if dense_too:
        cases["dense"] = dense
    y0 = y.clone()
    engine()
    want = y.clone()
    for name in [c for c in cases if c not in ("engine", "dense")]:  # every other form against the engine's expand
        y.copy_(y0)
        cases[name]()
        err = ((y.float() - want.float()).abs().max() / want.float().abs().max()).item()
        if err > 1e-2:
            raise AssertionError(f"{name} differs from the engine's expand by {err:.2e} ({site}, {adapters} adapters)")
    return {name: time_graph(graph_of(fn)) for name, fn in cases.items()} | {"bound": bound}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sites", nargs="+", default=list(SITES))
    p.add_argument("--tokens", type=int, nargs="+", default=[32])
    p.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 10, 27])
    p.add_argument("--ranks", type=int, nargs="+", default=[16])
    p.add_argument("--dense", action="store_true", help="also the dense cuBLAS reference")
    p.add_argument("--no-shapes", action="store_true", help="without the forced BGMV / SGMV launch shapes")
    p.add_argument("--columns", nargs="*", default=[], metavar="BLOCK_NxSTAGES[xGROUP]",
                   help="column_expand.py with these column tiles, pipeline stages and slots per program (default "
                        "all), e.g. 32x4 64x6 64x2x1")
    p.add_argument("--compact", action="store_true", help="adapters in the slots below their bound (compaction)")
    a = p.parse_args()
    columns = tuple(tuple(int(v) for v in c.split("x")) for c in a.columns)
    header = None
    for rank in a.ranks:
        for site in a.sites:
            for tokens in a.tokens:
                for adapters in a.adapters:
                    r = run(site, tokens, adapters, rank, a.dense, not a.no_shapes, columns, a.compact)
                    if header is None:
                        header = [k for k in r if k != "bound"]
                        names = " ".join(f"{h:>10}" for h in header)
                        print(f"{'site':8} {'r':>3} {'T':>4} {'ad':>3} {'bnd':>3} {names}")
                    best = min(header, key=r.get)
                    print(f"{site:8} {rank:3} {tokens:4} {adapters:3} {r['bound']:3} "
                          + " ".join(f"{r[h]:10.2f}" for h in header) + f"   best {best}")


if __name__ == "__main__":
    main()
