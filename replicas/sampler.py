"""Sampler: logits -> next tokens, batched over requests with different settings.

Order of operations (as in vLLM): penalties; min_tokens (EOS and the stop
token ids masked until that many tokens were generated), bad_words, logit_bias
and allowed_token_ids; the structured-output masks (replicas/grammar.py); then
greedy argmax for temperature-0 rows, and for the others temperature, min_p,
top_k, top_p and a draw (among torch.topk's candidates where top_k is small,
else over the sorted vocabulary). Logprobs are taken from the raw model logits
(log_softmax before any penalty or temperature), as vLLM returns them by
default.

A seeded request's noise is a hash of its seed, the draw's number and the
column (replicas/seeded_noise.py: one launch for every seeded row), so its
tokens do not depend on which other requests share the batch.

Nothing here waits for the GPU: with async scheduling the sampler's kernels
are queued behind a step that is still running, and the host must go on to
the next step meanwhile. So host values reach the device through pinned
memory without blocking (_on), a decision is taken on host values, never on a
device tensor, and the logprobs are read back only when first used (by then
the engine has read the step's tokens back, so nothing is left to wait for).
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from replicas.grammar import apply_token_masks
from replicas.sampling_params import SamplingParams
from replicas.seeded_noise import exponentials, key_pairs
from replicas.sequence import Sequence


@dataclass
class SampleLogprobs:
    """Logprobs of one generated token: the sampled one and the top-k of the step."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top_token_ids: list[int]
    top_logprobs: list[float]

    def as_dict(self) -> dict[int, float]:
        """{token_id: logprob} for the top-k plus the sampled token (vLLM's shape)."""
        d = dict(zip(self.top_token_ids, self.top_logprobs))
        d[self.token_id] = self.logprob
        return d


class SamplerOutput:
    """token_ids: [N] int64, on the logits' device. logprobs: one per row, None where the request asked for none;
    read back from the device on first use."""

    def __init__(self, token_ids: torch.Tensor, n: int, read_logprobs: Callable[[], list] | None = None) -> None:
        self.token_ids = token_ids
        self._n = n
        self._read = read_logprobs
        self._logprobs: list[SampleLogprobs | None] | None = None

    @property
    def logprobs(self) -> list[SampleLogprobs | None]:
        if self._logprobs is None:
            self._logprobs = self._read() if self._read is not None else [None] * self._n
        return self._logprobs

    def __iter__(self):  # unpacks as (token_ids, logprobs), as the named tuple it was
        return iter((self.token_ids, self.logprobs))


def _on(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor without waiting: a plain copy from pageable memory first waits for every
    kernel queued on the stream (the running step's), a pinned one does not."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


# Rows with top_k up to this many draw among their top-k candidates (torch.topk) instead of sorting the whole
# vocabulary for top-k / top-p: a sort of 32 x 128 K logits took about 1 ms of a decode step (H100,
# bench/sampling_settings.py, RESULTS.md twenty-seventh session).
TOP_K_CANDIDATES = 1024


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return _on(values, like.dtype, like.device).unsqueeze(1)


class Sampler:
    def sample(
        self,
        logits: torch.Tensor,
        seqs: Seq[Sequence],
        params: Seq[SamplingParams] | None = None,
        token_masks: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """logits: [N, V], one row per sequence (row i samples for seqs[i]).

        token_masks: the rows' structured-output bitmask (grammar.token_masks), or None.
        params defaults to each sequence's sampling_params. Penalties read the
        sequences' tokens (presence and frequency: outputs; repetition:
        prompt and outputs, as in vLLM and HF).
        """
        if params is None:
            params = [s.sampling_params for s in seqs]
        n, vocab = logits.shape
        if len(seqs) != n or len(params) != n:
            raise ValueError(f"sample: {n} logits rows for {len(seqs)} sequences and {len(params)} params")
        # Every step below makes new tensors (none writes in place), so raw stays the model's logits for the
        # logprobs without a copy: on a decode step that is the CUDA graph's static buffer.
        raw = logits = logits.float()

        if any(p.has_penalties for p in params):
            logits = self._apply_penalties(logits, seqs, params)
        restricted = self._apply_min_tokens_and_bias(logits, seqs, params)
        if token_masks is not None:  # where min_tokens or allowed_token_ids leave no token, the grammar wins
            restricted = apply_token_masks(restricted, token_masks, fallback=None if restricted is logits else logits)
        logits = restricted
        greedy_ids = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        token_ids = greedy_ids
        if random_rows:
            token_ids = greedy_ids.clone()
            few = [i for i in random_rows if 0 < params[i].top_k <= TOP_K_CANDIDATES]
            rest = [i for i in random_rows if not 0 < params[i].top_k <= TOP_K_CANDIDATES]
            for group, draw in ((few, self._draw_top_k), (rest, self._draw_vocab)):
                if group:
                    rows = _on(group, torch.long, logits.device)
                    token_ids[rows] = draw(logits[rows], [seqs[i] for i in group], [params[i] for i in group])

        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        return SamplerOutput(token_ids, n, self._logprobs(raw, token_ids, want, params, n) if want else None)

    # -- steps ------------------------------------------------------------
    @staticmethod
    def _apply_penalties(logits: torch.Tensor, seqs: Seq[Sequence], params: Seq[SamplingParams]) -> torch.Tensor:
        n, vocab = logits.shape
        device = logits.device

        # The outputs' ids, padded with an extra column that is dropped afterwards, through numpy: a nested list
        # through torch.tensor costs about 60 ns an id, every step.
        width = max(1, max(s.num_output_tokens for s in seqs))
        ids = np.full((n, width), vocab, dtype=np.int64)
        for i, s in enumerate(seqs):
            if s.output_token_ids:
                ids[i, : s.num_output_tokens] = s.output_token_ids
        ids_dev = torch.from_numpy(ids)
        ids_dev = ids_dev.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else ids_dev
        out_counts = torch.zeros((n, vocab + 1), dtype=logits.dtype, device=device)
        out_counts = out_counts.scatter_add_(1, ids_dev, torch.ones_like(ids_dev, dtype=logits.dtype))[:, :vocab]
        if any(p.repetition_penalty != 1 for p in params):
            rep = _column([p.repetition_penalty for p in params], logits)
            seen = torch.stack([s.prompt_mask(vocab, device) for s in seqs]) | (out_counts > 0)
            scaled = torch.where(logits > 0, logits / rep, logits * rep)
            logits = torch.where(seen, scaled, logits)
        freq = _column([p.frequency_penalty for p in params], logits)
        presence = _column([p.presence_penalty for p in params], logits)
        return logits - freq * out_counts - presence * (out_counts > 0).to(logits.dtype)

    @staticmethod
    def _apply_min_tokens_and_bias(logits: torch.Tensor, seqs: Seq[Sequence],
                                   params: Seq[SamplingParams]) -> torch.Tensor:
        """-inf on EOS (unless ignore_eos) and the stop token ids of rows short of min_tokens, and on each bad
        word's last token where the output ends with the rest of it; + each row's logit_bias; -inf on every token
        outside a row's allowed_token_ids. Out of place: logits may be a CUDA graph's output buffer."""
        vocab = logits.shape[1]
        rows: list[int] = []
        cols: list[int] = []
        values: list[float] = []
        for i, (seq, p) in enumerate(zip(seqs, params)):
            if p.min_tokens and seq.num_output_tokens < p.min_tokens:
                # a stop id past the vocabulary can never be sampled: nothing to mask
                banned = {t for t in p.stop_token_ids if t < vocab} | (set() if p.ignore_eos else seq.eos_token_ids)
                rows += [i] * len(banned)
                cols += banned
                values += [-math.inf] * len(banned)
            if seq.bad_words_ids:
                out = seq.output_token_ids
                banned = {w[-1] for w in seq.bad_words_ids
                          if w[-1] < vocab and len(w) - 1 <= len(out) and tuple(out[len(out) - len(w) + 1:]) == w[:-1]}
                rows += [i] * len(banned)
                cols += banned
                values += [-math.inf] * len(banned)
            if p.logit_bias:
                rows += [i] * len(p.logit_bias)
                cols += p.logit_bias
                values += p.logit_bias.values()
        device = logits.device
        if rows:
            index = (_on(rows, torch.long, device), _on(cols, torch.long, device))
            logits = logits.index_put(index, _on(values, logits.dtype, device), accumulate=True)
        allowed = [(i, p.allowed_token_ids) for i, p in enumerate(params) if p.allowed_token_ids]
        if allowed:  # every other token -inf: a mask of the allowed ones, applied out of place
            # (index_fill_ / index_put_ with a device value: `keep[index] = False` copies the value from the host)
            keep = torch.ones(logits.shape, dtype=torch.bool, device=device)
            keep.index_fill_(0, _on([i for i, _ in allowed], torch.long, device), False)
            cols = [t for _, ids in allowed for t in ids]
            rows = [i for i, ids in allowed for _ in ids]
            keep.index_put_((_on(rows, torch.long, device), _on(cols, torch.long, device)),
                            torch.ones(len(cols), dtype=torch.bool, device=device))
            logits = logits.masked_fill(~keep, -math.inf)
        return logits

    @staticmethod
    def _draw_top_k(logits: torch.Tensor, seqs: list[Sequence], params: list[SamplingParams]) -> torch.Tensor:
        """Rows with top_k <= TOP_K_CANDIDATES draw among their top k only (torch.topk, not a sort of the whole
        vocabulary); min_p and top_p then mask those candidates, as _draw_vocab masks the vocabulary."""
        logits = logits / _column([p.temperature for p in params], logits)
        top_k = [p.top_k for p in params]
        values, ids = logits.topk(max(top_k), dim=-1)  # most likely first
        positions = torch.arange(values.shape[1], device=values.device).unsqueeze(0)
        drop = positions >= _on(top_k, torch.long, values.device).unsqueeze(1)
        if any(p.min_p > 0 for p in params):  # p < min_p * p_max, on logits: l < l_max + ln(min_p)
            floor = _column([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params], values)
            drop = drop | (values < values[:, :1] + floor)
        values = values.masked_fill(drop, -math.inf)
        if any(p.top_p < 1 for p in params):
            probs = values.softmax(dim=-1)
            beyond = (probs.cumsum(dim=-1) - probs) >= _column([p.top_p for p in params], probs)
            beyond[:, 0].fill_(False)  # the most likely token always survives
            values = values.masked_fill(beyond, -math.inf)
        choice = _gumbel_argmax(values.softmax(dim=-1), seqs)
        return ids.gather(1, choice.unsqueeze(1)).squeeze(1)

    @staticmethod
    def _draw_vocab(logits: torch.Tensor, seqs: list[Sequence], params: list[SamplingParams]) -> torch.Tensor:
        logits = logits / _column([p.temperature for p in params], logits)

        if any(p.min_p > 0 for p in params):
            min_p = _column([p.min_p for p in params], logits)
            probs = logits.softmax(dim=-1)
            too_small = probs < min_p * probs.amax(dim=-1, keepdim=True)
            logits = logits.masked_fill(too_small, float("-inf"))

        top_k = [p.top_k_or_off for p in params]
        top_p = [p.top_p for p in params]
        if any(top_k) or any(p < 1 for p in top_p):
            logits = _apply_top_k_top_p(logits, top_k, top_p)

        return _gumbel_argmax(logits.softmax(dim=-1), seqs)

    @staticmethod
    def _logprobs(
        raw: torch.Tensor, token_ids: torch.Tensor, rows: list[int], params: Seq[SamplingParams], n: int
    ) -> Callable[[], list[SampleLogprobs | None]]:
        """Queue the rows' logprob kernels now; the returned function reads them back."""
        idx = _on(rows, torch.long, raw.device)
        lp = raw[idx].log_softmax(dim=-1)
        chosen = token_ids[idx]
        chosen_lp = lp.gather(1, chosen.unsqueeze(1))
        ranks = (lp > chosen_lp).sum(dim=-1) + 1
        top_lp, top_ids = lp.topk(max(params[i].logprobs for i in rows), dim=-1)
        kks = [params[i].logprobs for i in rows]
        # Copied to pinned host memory now, behind the sampling: `.tolist()` on the device tensors later would
        # wait for everything queued by then, the next step's forward pass among them.
        parts = [t.to("cpu", non_blocking=True) for t in (top_lp, top_ids, chosen, chosen_lp.squeeze(1), ranks)]
        copied = None
        if raw.is_cuda:
            copied = torch.cuda.Event()
            copied.record()

        def read() -> list[SampleLogprobs | None]:
            if copied is not None:
                copied.synchronize()
            tl, ti, ch, chl, rk = (t.tolist() for t in parts)
            out: list[SampleLogprobs | None] = [None] * n
            for j, (i, kk) in enumerate(zip(rows, kks)):
                out[i] = SampleLogprobs(ch[j], chl[j], rk[j], ti[j][:kk], tl[j][:kk])
            return out

        return read


def _gumbel_argmax(probs: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
    """A draw from each row of probs: argmax(p / q) with q ~ Exp(1). A seeded row's q is a hash of its seed,
    its draw's number and the column (replicas/seeded_noise.py, one launch for all of them), so its draws do
    not depend on the rows beside it."""
    keys = [seq.take_noise_key() for seq in seqs]
    seeded = [i for i, key in enumerate(keys) if key is not None]
    pairs = key_pairs([keys[i] for i in seeded])
    if len(seeded) == len(keys):
        q = exponentials(_on(pairs, torch.long, probs.device), probs.shape[1])
    else:
        q = torch.empty_like(probs).exponential_()
        if seeded:
            q[_on(seeded, torch.long, probs.device)] = exponentials(_on(pairs, torch.long, probs.device),
                                                                     probs.shape[1])
    return (probs / q).argmax(dim=-1)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top_k (0 = off) and top_p nucleus.

    The most likely token always survives, so top_p near 0 is greedy.
    """
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    positions = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = _on([kk if kk > 0 else vocab for kk in top_k], torch.long, logits.device).unsqueeze(1)
    drop = positions >= k
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
    p = _on(top_p, probs.dtype, logits.device).unsqueeze(1)
    drop = drop | (before >= p)
    drop[:, 0].fill_(False)
    return logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
