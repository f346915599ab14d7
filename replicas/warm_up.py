"""Before traffic, on GPU: compile every kernel variant and capture the CUDA graphs of a ModelRunner.

Functions over a runner (all TP ranks run them together), kept apart from the
runner's step path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from replicas import candidate_draw, nucleus_draw
from replicas.attention import AttentionMetadata
from replicas.seeded_noise import exponentials, key_pairs
from replicas.triton_compile import compile_ahead

if TYPE_CHECKING:
    from replicas.model_runner import ModelRunner


def warm_up(runner: "ModelRunner") -> int:
    """Before traffic, on GPU (all TP ranks together): compile the kernels, capture the decode graphs.

    Triton compiles a kernel for each new combination of its constexprs
    (tile heights, attention query block) and of its integer arguments'
    classes (1, a multiple of 16, other: a step's sequence count is one):
    left to the first request that needs one, that costs a second or more in
    the middle of serving. Synthetic prefill-shaped steps of 1, 3 and 16
    sequences cover them, and the graphs' own eager passes the rest. Both run
    first under compile_ahead, which compiles their variants in worker
    processes and launches nothing (replicas/triton_compile.py: a fresh
    node's cold start); the steps and captures after it load every variant
    from Triton's disk cache. Returns the graph count.
    """
    if runner.device.type != "cuda":
        return 0
    with compile_ahead(runner.cfg.compile_workers) as ahead:
        if ahead is not None:
            synthetic_steps(runner)
            run_graphs_eagerly(runner)
            draw_kernels(runner)
    synthetic_steps(runner)  # for real: every variant loaded (or compiled) before traffic
    draw_kernels(runner)
    torch.cuda.synchronize(runner.device)
    return capture_graphs(runner)


def synthetic_steps(runner: "ModelRunner") -> None:
    """Prefill-shaped steps over the token counts, sequence counts and adapter counts whose kernel
    variants differ."""
    cfg = runner.cfg
    room = min(cfg.max_num_batched_tokens, runner.num_blocks * cfg.block_size)
    counts = (0, 1, min(runner.cfg.lora_config.max_loras, 8)) if runner.punica else (0,)
    for tokens in sorted({min(t, room) for t in (16, 48, 200, 1500)}):
        for seqs in (1, 3, 16):
            fits = tokens + seqs * cfg.block_size <= runner.num_blocks * cfg.block_size
            if seqs <= min(tokens, cfg.max_num_seqs) and fits:
                for adapters in counts:
                    synthetic_step(runner, tokens, adapters, seqs)


@torch.inference_mode()
def synthetic_step(runner: "ModelRunner", num_tokens: int, num_adapters: int, num_seqs: int = 1) -> torch.Tensor:
    """One prefill step: num_tokens split over num_seqs sequences and num_adapters LoRA slots, in
    blocks 0.. (call only while no sequence holds them: before traffic). Returns each sequence's
    last-row logits [num_seqs, V]."""
    bs = runner.cfg.block_size
    lens = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
    tables, first = [], 0
    for n in lens:
        tables.append(list(range(first, first + -(-n // bs))))
        first += len(tables[-1])
    if runner.punica is not None:
        runner.punica.set_decode_layout(num_tokens, num_adapters, num_sampled=num_seqs)
    meta = AttentionMetadata.build(lens, lens, tables, bs, runner.device)
    positions = torch.cat([torch.arange(n) for n in lens]).to(runner.device)
    ids = torch.arange(num_tokens, device=runner.device) % runner.model_config.vocab_size
    hidden = runner.model(ids, positions, runner.kv_caches, meta)
    last = torch.tensor(lens).cumsum(0).sub_(1).to(runner.device)
    return runner.model.compute_logits(hidden.index_select(0, last)).float()


@torch.inference_mode()
def draw_kernels(runner: "ModelRunner") -> None:
    """The sampler's Triton kernels over random logits, once per variant, on rank 0 (the rank whose logits the
    engine samples): the candidate draw at each width (candidate_draw.candidate_widths), the nucleus draw, the
    seeded noise over the vocabulary, the penalties and the logprobs. Without it the first request with top_p,
    or with a top_k of a new power of two, compiled its variant in the middle of serving (bench/engine.py
    --sampling nucleus named it)."""
    # the sampler's modules import more than a runner needs
    from replicas.penalties import PenaltyState
    from replicas.sampler import TOP_K_CANDIDATES
    from replicas.sampling_params import SamplingParams
    from replicas.sequence import Sequence
    from replicas.token_logprobs import token_logprobs

    if runner.ctx.tp_rank != 0:
        return
    vocab = runner.model_config.vocab_size
    logits = torch.randn(2, vocab, device=runner.device)
    pairs = torch.tensor(key_pairs([1, 2]), device=runner.device)
    for width in candidate_draw.candidate_widths(vocab, TOP_K_CANDIDATES):
        values, ids = logits.topk(width, dim=-1)
        settings = torch.tensor([candidate_draw.settings_row(1.0, width, 0.9, 0.0)] * 2, device=runner.device)
        candidate_draw.draw_candidates(values, ids, settings, pairs)
    settings = torch.tensor([nucleus_draw.settings_row(1.0, 0.9, 0.0)] * 2, device=runner.device)
    nucleus_draw.draw_nucleus(logits, settings, pairs)
    exponentials(pairs, vocab)
    tokens = logits.argmax(dim=-1)
    token_logprobs(logits, tokens, 2)
    penalties = PenaltyState()
    seqs = [Sequence(f"warm-up {i}", [1], SamplingParams(presence_penalty=1.0)) for i in range(2)]
    penalties.record(penalties.apply(logits, seqs, [s.sampling_params for s in seqs])[1], tokens)


def _layouts(runner: "ModelRunner"):
    """(decode set_layout, decode layouts, piecewise set_layout, piecewise layouts); all None without LoRA."""
    punica = runner.punica
    if punica is None:
        return None, None, None, None
    return (punica.apply_layout, punica.decode_layouts,
            lambda rows, layout: punica.apply_layout(rows, layout, num_sampled=1), punica.token_layouts)


def run_graphs_eagerly(runner: "ModelRunner") -> None:
    """Every graph's eager pass, capturing none (under compile_ahead: their variants' compiles)."""
    decode_set, decode_layouts, piece_set, piece_layouts = _layouts(runner)
    with torch.inference_mode():
        if runner.decode_graphs is not None:
            runner.decode_graphs.run_all_eager(decode_set, decode_layouts)
        if runner.piecewise is not None:
            runner.piecewise.run_all_eager(piece_set, piece_layouts)


def capture_graphs(runner: "ModelRunner") -> int:
    """Capture every decode graph and piecewise graph before traffic (all TP ranks together); returns
    how many. Decode graphs cover the sampled rows' LoRA layout too; pieces stop before the LM head."""
    decode_set, decode_layouts, piece_set, piece_layouts = _layouts(runner)
    count = 0
    with torch.inference_mode():
        if runner.decode_graphs is not None:
            count += runner.decode_graphs.capture_all(decode_set, decode_layouts)
        if runner.piecewise is not None:
            count += runner.piecewise.capture_all(piece_set, piece_layouts)
    return count

