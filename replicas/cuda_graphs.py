"""Decode steps replayed from CUDA graphs: one graph per padded batch size and LoRA launch layout.

An eager decode step launches some 40 kernels per layer, each a few
microseconds of work behind tens of microseconds of Python and launch
overhead: a Llama-3-8B step at batch 32 took 23 ms eager against a 4 ms
memory bound (bench/RESULTS.md). A graph replays the whole step in one launch.

A graph freezes two things, and a step still varies through both:
- tensor addresses. Every input of the step lives in a static buffer here
  (token ids, positions, context lengths, block tables, KV slots) that each
  step overwrites before the replay; the LoRA slot buffers and the punica
  metadata are static already (lora_core allocates them once).
- host-side launch parameters: the batch size, padded up to a captured size,
  and the punica layout (any adapter active? BGMV or SGMV, tile height and
  count). Both make up the graph's key.

Padding rows decode token 0 at position 0 with no adapter, over a one-token
context in a scratch KV block that no sequence owns (the runner allocates it
past the block manager's blocks); their logits are dropped.

On CPU nothing is captured: ``DecodeGraphs(capture=False)`` runs the same
padded, static-buffer step eagerly, which is how CI tests the padding.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from typing import Any, Callable, Iterator

import torch

from replicas.attention import AttentionMetadata

log = logging.getLogger(__name__)


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool: Any = None) -> Iterator[None]:
    """torch.cuda.graph(graph, pool) with Python's garbage collector held off until the capture ends.

    A collection that runs inside a capture (any allocation may start one) can free what dropped objects held,
    such as an earlier engine's CUDA graphs and memory pool in the same process; a cudaFree or a graph's
    destruction during a capture invalidates it (cudaErrorStreamCaptureInvalidated). A capture allocates few
    Python objects, so the garbage waits for the collector's next run. thread_local: adapter loads on loader
    threads may pin host memory while a capture runs."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            yield
    finally:
        if was_enabled:
            gc.enable()


def capture_sizes(max_batch: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 8 up to 64, then every 16 (as vLLM pads)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch]
    size = 8
    while size < max_batch:
        sizes.append(size)
        size += 8 if size < 64 else 16
    return sizes + [max_batch]


def layout_keys(sizes: list[int], set_layout: Callable[[int, Any], None] | None,
                layouts: Callable[[int], dict[tuple, Any]] | None,
                launch_key: Callable[[], tuple | None]) -> Iterator[tuple[int, tuple]]:
    """(size, graph key) for every size, largest first (a shared pool then fits all), and every LoRA
    layout of it: set_layout(size, layout) sets synthetic punica metadata for each layout (a
    punica StepLayout) that layouts(size) lists, before launch_key() is read. Both None without LoRA."""
    for size in sorted(sizes, reverse=True):
        for layout in (layouts(size).values() if layouts else (None,)):
            if set_layout:
                set_layout(size, layout)
            yield size, (size, launch_key())


class DecodeGraphs:
    """Static inputs and captured graphs of the pure decode steps of one ModelRunner.

    forward(input_ids [B], positions [B], meta) -> logits [B, V] (any float dtype;
    copied into a float32 buffer) is the runner's model step; launch_key()
    returns the punica layout of the step whose metadata was just set (None
    without LoRA).
    """

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
                 launch_key: Callable[[], tuple | None], max_batch: int, max_blocks_per_seq: int, block_size: int,
                 pad_block: int, vocab_size: int, device: torch.device, capture: bool) -> None:
        self._forward, self._launch_key = forward, launch_key
        self.sizes = capture_sizes(max_batch)
        self.max_batch, self.block_size, self.pad_block = max_batch, block_size, pad_block
        self.device, self.capture = device, capture
        int32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, **int32)
        self.seq_lens = torch.ones(max_batch, **int32)
        self.block_tables = torch.full((max_batch, max_blocks_per_seq), pad_block, **int32)
        self.slot_mapping = torch.full((max_batch,), pad_block * block_size, dtype=torch.long, device=device)
        self.logits = torch.zeros(max_batch, vocab_size, dtype=torch.float32, device=device)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool = None

    def release(self) -> None:
        """Free every captured graph and their memory pool (the runner is closing)."""
        if self.graphs and torch.cuda.is_available():
            torch.cuda.synchronize(self.device)
        self.graphs.clear()
        self._pool = None

    def padded_size(self, num_seqs: int) -> int | None:
        """The smallest captured size that holds num_seqs sequences (None: too many, run eager)."""
        return next((s for s in self.sizes if s >= num_seqs), None)

    def _meta(self, batch: int, seq_lens: tuple[int, ...]) -> AttentionMetadata:
        """Views of the static buffers; the host tuples serve only the CPU reference attention."""
        return AttentionMetadata(query_start_loc=self.query_start_loc[: batch + 1], seq_lens=self.seq_lens[:batch],
                                 block_tables=self.block_tables[:batch], slot_mapping=self.slot_mapping[:batch],
                                 max_query_len=1, max_seq_len=max(seq_lens, default=1),
                                 query_lens_host=(1,) * batch, seq_lens_host=seq_lens)

    def load(self, input_ids: list[int], positions: list[int], block_tables: list[list[int]], batch: int) -> tuple:
        """Write one decode step (a token per sequence) into the buffers, padded to batch rows.

        Returns the host context lengths (padding rows: 1).
        """
        n = len(input_ids)
        if len(block_tables) != n or len(positions) != n or n > batch:
            raise ValueError(f"a decode step of {n} sequences does not fit {batch} rows")
        pad = batch - n
        bs = self.block_size
        slots = [table[p // bs] * bs + p % bs for table, p in zip(block_tables, positions)]
        width = max((len(t) for t in block_tables), default=1)
        if width > self.block_tables.shape[1]:
            raise ValueError(f"a sequence holds {width} blocks; graphs were sized for {self.block_tables.shape[1]}")
        tables = [list(t) + [self.pad_block] * (width - len(t)) for t in block_tables]
        tables += [[self.pad_block] * width] * pad
        seq_lens = tuple(p + 1 for p in positions) + (1,) * pad

        def put(dst: torch.Tensor, data, dtype) -> None:
            dst.copy_(torch.tensor(data, dtype=dtype), non_blocking=True)

        put(self.input_ids[:batch], list(input_ids) + [0] * pad, torch.long)
        put(self.positions[:batch], list(positions) + [0] * pad, torch.long)
        put(self.seq_lens[:batch], seq_lens, torch.int32)
        put(self.slot_mapping[:batch], slots + [self.pad_block * bs] * pad, torch.long)
        put(self.block_tables[:batch, :width], tables, torch.int32)
        return seq_lens

    def run(self, input_ids: list[int], positions: list[int], block_tables: list[list[int]],
            batch: int, fill: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Logits [len(input_ids), V] of a loaded decode step (the LoRA metadata is already set for batch rows).

        fill(input_ids) may then overwrite token ids on the device (async scheduling's pending tokens).
        A view of a static buffer: valid until the next step.
        """
        seq_lens = self.load(input_ids, positions, block_tables, batch)
        if fill is not None:
            fill(self.input_ids[:batch])
        n = len(input_ids)
        if not self.capture:
            self.logits[:batch].copy_(self._forward(self.input_ids[:batch], self.positions[:batch],
                                                    self._meta(batch, seq_lens)))
            return self.logits[:n]
        key = (batch, self._launch_key())
        graph = self.graphs.get(key)
        if graph is None:
            log.info("capturing a CUDA graph for decode layout %s on first use", key)
            graph = self._capture(key, batch)
        graph.replay()
        return self.logits[:n]

    def _eager(self, batch: int) -> None:
        """The padding rows' step, eagerly. Rerunning a decode step rewrites the same K/V: harmless."""
        self._forward(self.input_ids[:batch], self.positions[:batch], self._meta(batch, (1,) * batch))

    def _capture(self, key: tuple, batch: int) -> torch.cuda.CUDAGraph:
        meta = self._meta(batch, (1,) * batch)
        # One eager run first: Triton compiles (or loads what warm-up compiled), and lazily built tables and
        # workspaces are allocated outside the graph.
        self._eager(batch)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with capturing(graph, self._pool):
            logits = self._forward(self.input_ids[:batch], self.positions[:batch], meta)
            self.logits[:batch].copy_(logits)
        self._pool = graph.pool()  # every graph shares one pool: only one replays at a time
        self.graphs[key] = graph
        return graph

    def capture_all(self, set_layout: Callable[[int, Any], None] | None,
                    layouts: Callable[[int], dict[tuple, Any]] | None) -> int:
        """Capture every size and LoRA layout ahead of traffic, largest first (the pool then fits all).

        The buffers hold padding rows only while capturing, so no real KV is
        touched. set_layout(batch, layout) sets synthetic punica metadata and
        layouts(batch) lists the layouts to cover; both None without LoRA.
        """
        if not self.capture:
            return 0
        self.load([], [], [], self.max_batch)
        for batch, key in layout_keys(self.sizes, set_layout, layouts, self._launch_key):
            if key not in self.graphs:
                self._capture(key, batch)
        torch.cuda.synchronize(self.device)
        return len(self.graphs)

    def run_all_eager(self, set_layout: Callable[[int, Any], None] | None,
                      layouts: Callable[[int], dict[tuple, Any]] | None) -> None:
        """The eager pass of every graph capture_all() would capture, capturing none (warm-up runs it
        under replicas.triton_compile.compile_ahead, so their Triton variants compile side by side)."""
        if not self.capture:
            return
        self.load([], [], [], self.max_batch)
        seen = set(self.graphs)
        for batch, key in layout_keys(self.sizes, set_layout, layouts, self._launch_key):
            if key not in seen:  # each right after set_layout set its metadata
                seen.add(key)
                self._eager(batch)
