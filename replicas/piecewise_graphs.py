"""Steps with prompt tokens replayed from CUDA graphs piece by piece, the attentions run eagerly between.

A step with prompt tokens used to run eagerly: some 320 kernel launches on
a Llama-3-8B (590 with LoRA), each behind tens of microseconds of Python, so
the host took 26-58 ms for a step whose kernels kept the GPU busy 10-18 ms. Such a step's attention depends on how the
tokens split into sequences, a host-side shape; everything else in a layer
(norms, projections and their LoRA, rotary, MLP, the TP all-reduces) depends
only on the token count. So the model is cut at its attentions into
num_layers + 1 pieces (LlamaModel.forward_piece), each captured per padded
token count and punica layout, as vLLM does with its piecewise graphs:

    piece 0: embed, layer 0 up to q/k/v | attention 0 (eager) | piece 1: layer 0 from o_proj,
    layer 1 up to q/k/v | attention 1 | ... | piece L: layer L-1 from o_proj, final norm

Pieces pass tensors through static buffers (ids, positions, q, k, v,
attention output, residual, final hidden), which each graph reads and
writes at fixed addresses. Padding rows (token 0 at position 0, no adapter)
only ever reach the pieces: every op there works row by row, and the eager
attention sees the real rows only, so padding neither reads nor writes
the KV cache. On CPU nothing is captured: ``capture=False`` runs the same
pieces and buffers eagerly, which is how CI tests them.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from replicas.attention import AttentionMetadata
from replicas.cuda_graphs import capturing, layout_keys

log = logging.getLogger(__name__)


def piecewise_sizes(max_tokens: int) -> list[int]:
    """Padded token counts: 16, 32, then four per doubling (at most 25% padding), up to max_tokens."""
    sizes, size = [], 16
    while size < max_tokens:
        sizes.append(size)
        size += 16 if size < 32 else max(32, (1 << (size.bit_length() - 1)) // 4)
    return sizes + [max_tokens]


class PiecewiseGraphs:
    """Static buffers and captured pieces of the steps the decode graphs do not cover.

    model: a LlamaForCausalLM (its .model has forward_piece and layers);
    launch_key() returns the punica token layout just set (None without LoRA).
    """

    def __init__(self, model: torch.nn.Module, kv_caches: list, launch_key: Callable[[], tuple | None],
                 max_tokens: int, device: torch.device, capture: bool) -> None:
        self._model = model.model
        self._layers = list(self._model.layers)
        self._kv_caches, self._launch_key = kv_caches, launch_key
        self.sizes = piecewise_sizes(max_tokens)
        self.max_tokens, self.device, self.capture = max_tokens, device, capture
        attn = self._layers[0].self_attn
        dtype, hidden = self._model.norm.weight.dtype, self._model.norm.weight.shape[0]

        def buffer(width: int) -> torch.Tensor:  # zeros: padding rows hold finite values from the start
            return torch.zeros(max_tokens, width, dtype=dtype, device=device)

        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.q, self.k, self.v = buffer(attn.q_size), buffer(attn.kv_size), buffer(attn.kv_size)
        self.attn, self.residual, self.hidden = buffer(attn.q_size), buffer(hidden), buffer(hidden)
        self.graphs: dict[tuple, list[torch.cuda.CUDAGraph]] = {}
        self._pool = None

    @property
    def num_pieces(self) -> int:
        return len(self._layers) + 1

    def padded_size(self, num_tokens: int) -> int | None:
        """The smallest captured size that holds num_tokens rows (None: too many, run eager)."""
        return next((s for s in self.sizes if s >= num_tokens), None)

    def release(self) -> None:
        """Free every captured piece and their memory pool (the runner is closing)."""
        if self.graphs and torch.cuda.is_available():
            torch.cuda.synchronize(self.device)
        self.graphs.clear()
        self._pool = None

    def _piece(self, i: int, size: int) -> None:
        """Run piece i over the first size rows of the static buffers (the body every graph captures)."""
        out = self._model.forward_piece(i, self.positions[:size], self.input_ids[:size], self.attn[:size],
                                        self.residual[:size])
        if i == len(self._layers):
            self.hidden[:size].copy_(out[0])
            return
        for dst, src in zip((self.q, self.k, self.v, self.residual), out):
            dst[:size].copy_(src)

    def run(self, input_ids: list[int], positions: list[int], meta: AttentionMetadata, size: int,
            fill: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Final hidden states [len(input_ids), H] of a step padded to size rows (its punica metadata,
        padded alike, already set); meta describes the real rows. fill(input_ids) may then overwrite
        token ids on the device (async scheduling). A view of a static buffer: valid until the next step."""
        n = len(input_ids)
        if n > size or size not in self.sizes:
            raise ValueError(f"a step of {n} tokens does not fit a piecewise size of {size}")
        pad = size - n
        self.input_ids[:size].copy_(torch.tensor(list(input_ids) + [0] * pad, dtype=torch.long), non_blocking=True)
        self.positions[:size].copy_(torch.tensor(list(positions) + [0] * pad, dtype=torch.long), non_blocking=True)
        if fill is not None:
            fill(self.input_ids[:size])
        pieces = None
        if self.capture:
            key = (size, self._launch_key())
            pieces = self.graphs.get(key)
            if pieces is None:
                log.info("capturing piecewise CUDA graphs for layout %s on first use", key)
                pieces = self._capture(key, size)
        for i in range(self.num_pieces):
            if pieces is None:
                self._piece(i, size)
            else:
                pieces[i].replay()
            if i < len(self._layers):
                layer = self._layers[i]
                out = layer.self_attn.attn(self.q[:n], self.k[:n], self.v[:n], self._kv_caches[i], meta)
                self.attn[:n].copy_(out)
        return self.hidden[:n]

    def _capture(self, key: tuple, size: int) -> list[torch.cuda.CUDAGraph]:
        # One eager pass first: Triton compiles (or loads what warm-up compiled), and lazily built workspaces
        # are allocated outside the graphs. Pieces touch no KV cache, so this writes only the static buffers.
        self._eager(size)
        torch.cuda.synchronize(self.device)
        pieces = []
        for i in range(self.num_pieces):
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, self._pool):
                self._piece(i, size)
            # One pool for all: pieces replay one at a time, in capture order.
            self._pool = graph.pool()
            pieces.append(graph)
        self.graphs[key] = pieces
        return pieces

    def capture_all(self, set_layout: Callable[[int, Any], None] | None,
                    layouts: Callable[[int], dict[tuple, Any]] | None) -> int:
        """Capture every size and LoRA token layout before traffic, largest first; returns the graph count.

        set_layout(size, layout) sets synthetic punica metadata and layouts(size) lists the
        layouts to cover; both None without LoRA.
        """
        if not self.capture:
            return 0
        for size, key in layout_keys(self.sizes, set_layout, layouts, self._launch_key):
            if key not in self.graphs:
                self._capture(key, size)
        torch.cuda.synchronize(self.device)
        return sum(len(p) for p in self.graphs.values())

    def run_all_eager(self, set_layout: Callable[[int, Any], None] | None,
                      layouts: Callable[[int], dict[tuple, Any]] | None) -> None:
        """The eager pass of every size and layout capture_all() would capture, capturing none (warm-up runs
        it under replicas.triton_compile.compile_ahead)."""
        if not self.capture:
            return
        seen = set(self.graphs)
        for size, key in layout_keys(self.sizes, set_layout, layouts, self._launch_key):
            if key not in seen:  # each right after set_layout set its metadata
                seen.add(key)
                self._eager(size)

    def _eager(self, size: int) -> None:
        for i in range(self.num_pieces):
            self._piece(i, size)
