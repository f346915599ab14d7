"""Sampler: logits -> next tokens, batched over requests with different settings.

Order of operations (as in vLLM): penalties (replicas/penalties.py: counts kept
on the device between steps); min_tokens (EOS and the stop
token ids masked until that many tokens were generated), bad_words, logit_bias
and allowed_token_ids; the structured-output masks (replicas/grammar.py); then
greedy argmax for temperature-0 rows, and for the others temperature, min_p,
top_k, top_p and a draw: among torch.topk's candidates where top_k is small
(replicas/candidate_draw.py), over the vocabulary without a sort where top_k
is off (replicas/nucleus_draw.py), each in one launch on CUDA; else over the
sorted vocabulary. Logprobs are taken from the raw model logits
(log_softmax before any penalty or temperature), as vLLM returns them by
default.

A draw is argmax(p / q), q ~ Exp(1), with q a hash of the row's key and the
column (replicas/seeded_noise.py: one launch for all rows). A seeded request's
key comes from its seed and the draw's number, so its tokens do not depend on
which other requests share the batch; any other row's key is fresh random bits.

Nothing here waits for the GPU: with async scheduling the sampler's kernels
are queued behind a step that is still running, and the host must go on to
the next step meanwhile. So host values reach the device through pinned
memory without blocking (_on), a decision is taken on host values, never on a
device tensor, and the logprobs are read back only when first used (by then
the engine has read the step's tokens back, so nothing is left to wait for).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Callable

import torch

from replicas import candidate_draw, nucleus_draw
from replicas.grammar import apply_token_masks
from replicas.penalties import PenaltyState
from replicas.sampling_params import SamplingParams
from replicas.seeded_noise import exponentials, key_pairs
from replicas.token_logprobs import token_logprobs
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
# bench/sampling_settings.py).
TOP_K_CANDIDATES = 1024


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return _on(values, like.dtype, like.device).unsqueeze(1)


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        # Keys of rows without a seed of their own: any random bits do; seeded, the same bits run after run.
        self._fresh_keys = random.Random(seed)
        self.penalties = PenaltyState()

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

        penalized = None
        if any(p.has_penalties for p in params):
            logits, penalized = self.penalties.apply(logits, seqs, params)
        restricted = self._apply_min_tokens_and_bias(logits, seqs, params)
        if token_masks is not None:  # where min_tokens or allowed_token_ids leave no token, the grammar wins
            restricted = apply_token_masks(restricted, token_masks, fallback=None if restricted is logits else logits)
        logits = restricted
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        few = [i for i in random_rows if 0 < params[i].top_k <= TOP_K_CANDIDATES]
        nucleus = [i for i in random_rows if params[i].top_k_or_off == 0]
        rest = [i for i in random_rows if params[i].top_k > TOP_K_CANDIDATES]
        draws = [(group, draw) for group, draw in
                 ((few, self._draw_top_k), (nucleus, self._draw_nucleus), (rest, self._draw_vocab)) if group]
        if len(draws) == 1 and len(draws[0][0]) == n:  # one kind of draw for every row: no gather, no scatter
            token_ids = draws[0][1](logits, self._noise_keys(seqs), params)
        else:
            token_ids = logits.argmax(dim=-1)
            for group, draw in draws:
                rows = _on(group, torch.long, logits.device)
                keys = self._noise_keys([seqs[i] for i in group])
                token_ids[rows] = draw(logits[rows], keys, [params[i] for i in group])

        if penalized is not None:
            self.penalties.record(penalized, token_ids)
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        return SamplerOutput(token_ids, n, self._logprobs(raw, token_ids, want, params, n) if want else None)

    def _noise_keys(self, seqs: Seq[Sequence]) -> list[int]:
        """Each row's noise key for this draw: a seeded request's own (Sequence.take_noise_key), else fresh bits."""
        keys = [seq.take_noise_key() for seq in seqs]
        return [self._fresh_keys.getrandbits(64) if key is None else key for key in keys]

    # -- steps ------------------------------------------------------------
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
    def _draw_top_k(logits: torch.Tensor, keys: list[int], params: Seq[SamplingParams]) -> torch.Tensor:
        """Rows with top_k <= TOP_K_CANDIDATES draw among their top k only (torch.topk, not a sort of the whole
        vocabulary); temperature, min_p and top_p then apply to those candidates (replicas/candidate_draw.py).
        Temperature > 0 keeps the order, so the candidates are taken from the raw logits."""
        width = candidate_draw.candidate_width(max(p.top_k for p in params), logits.shape[1])
        values, ids = logits.topk(width, dim=-1)  # most likely first
        settings = _on([candidate_draw.settings_row(p.temperature, p.top_k, p.top_p, p.min_p) for p in params],
                       torch.float32, logits.device)
        return candidate_draw.draw_candidates(values, ids, settings, _on(key_pairs(keys), torch.long, logits.device))

    @staticmethod
    def _draw_nucleus(logits: torch.Tensor, keys: list[int], params: Seq[SamplingParams]) -> torch.Tensor:
        """Rows without top_k: min_p and top_p over the whole vocabulary, without sorting it
        (replicas/nucleus_draw.py)."""
        settings = _on([nucleus_draw.settings_row(p.temperature, p.top_p, p.min_p) for p in params], torch.float32,
                       logits.device)
        return nucleus_draw.draw_nucleus(logits, settings, _on(key_pairs(keys), torch.long, logits.device))

    @staticmethod
    def _draw_vocab(logits: torch.Tensor, keys: list[int], params: Seq[SamplingParams]) -> torch.Tensor:
        """Rows with top_k above TOP_K_CANDIDATES: top_k and top_p on the sorted vocabulary."""
        logits = logits / _column([p.temperature for p in params], logits)

        if any(p.min_p > 0 for p in params):
            min_p = _column([p.min_p for p in params], logits)
            probs = logits.softmax(dim=-1)
            too_small = probs < min_p * probs.amax(dim=-1, keepdim=True)
            logits = logits.masked_fill(too_small, float("-inf"))

        logits = _apply_top_k_top_p(logits, [p.top_k for p in params], [p.top_p for p in params])
        return _gumbel_argmax(logits.softmax(dim=-1), keys)

    @staticmethod
    def _logprobs(
        raw: torch.Tensor, token_ids: torch.Tensor, rows: list[int], params: Seq[SamplingParams], n: int
    ) -> Callable[[], list[SampleLogprobs | None]]:
        """Queue the rows' logprob kernels now (replicas/token_logprobs.py); the returned function reads them
        back."""
        if len(rows) < n:
            idx = _on(rows, torch.long, raw.device)
            raw, token_ids = raw[idx], token_ids[idx]
        kks = [params[i].logprobs for i in rows]
        k = max(kks)
        # Copied to pinned host memory now, behind the sampling: `.tolist()` on the device tensor later would
        # wait for everything queued by then, the next step's forward pass among them.
        packed = token_logprobs(raw, token_ids, k).to("cpu", non_blocking=True)
        copied = None
        if raw.is_cuda:
            copied = torch.cuda.Event()
            copied.record()

        def read() -> list[SampleLogprobs | None]:
            if copied is not None:
                copied.synchronize()
            out: list[SampleLogprobs | None] = [None] * n
            for i, kk, (token, logprob, rank, *tops) in zip(rows, kks, packed.tolist()):
                out[i] = SampleLogprobs(int(token), logprob, int(rank), [int(t) for t in tops[k: k + kk]], tops[:kk])
            return out

        return read


def _gumbel_argmax(probs: torch.Tensor, keys: list[int]) -> torch.Tensor:
    """A draw from each row of probs: argmax(p / q), q ~ Exp(1) the hash of the row's key and the column."""
    return (probs / exponentials(_on(key_pairs(keys), torch.long, probs.device), probs.shape[1])).argmax(dim=-1)


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
