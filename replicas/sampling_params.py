"""SamplingParams: how one request picks its tokens (shaped like vLLM's)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from replicas.errors import InvalidRequestError
from replicas.structured_outputs import StructuredOutputsParams

MAX_LOGPROBS = 20
MAX_N = 128  # completions per request (OpenAI's limit); each is a sequence of its own (parallel_sampling.py)
MAX_BIAS = 100  # logit_bias's bound, OpenAI's: -100 bans a token, 100 all but forces it


class RequestOutputKind(enum.IntEnum):
    """vLLM's: what each RequestOutput of a request holds. CUMULATIVE: everything so far, at every step.
    DELTA: the tokens, text and logprobs new since the request's previous output (a streaming server sends
    them as they are, and nothing is copied per step but the new part). FINAL_ONLY: one output, when the
    request finishes (LLM.generate asks for it: the steps build no output it would throw away)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    """A finite number (not a bool): an infinite temperature or penalty reaches the sampler as NaN logits."""
    return isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and math.isfinite(v)


def _token_bias(value: object) -> dict[int, float] | None:
    """logit_bias with int keys (JSON sends them as strings: OpenAI's {"50256": -100}), or None if malformed."""
    if not isinstance(value, dict):
        return None
    out: dict[int, float] = {}
    for key, bias in value.items():
        if isinstance(key, str) and key.isascii() and key.isdigit():
            key = int(key)
        if not _is_int(key) or key < 0 or not _is_num(bias) or not -MAX_BIAS <= bias <= MAX_BIAS:
            return None
        out[key] = float(bias)
    return out


@dataclass
class SamplingParams:
    """Sampling settings for one request.

    n completions per request (replicas/parallel_sampling.py; with a seed, completion i samples with
    seed + i). temperature 0 means greedy. top_k -1 or 0 means off. logprobs=k returns
    the k most likely tokens of each step (from the raw model distribution)
    plus the sampled one. stop strings are matched by the detokenizer;
    stop_token_ids and EOS by the scheduler; before min_tokens generated tokens none of them can end it (EOS
    and the stop ids cannot be sampled, stop strings are not looked for), as in vLLM. logit_bias (OpenAI's)
    adds a bias in [-100, 100] to the named tokens' logits before sampling (the engine checks the ids against
    the vocabulary). prompt_logprobs=k gives each prompt token's logprob and its position's top k
    (replicas/prompt_logprobs.py). allowed_token_ids (vLLM's) restricts sampling to those tokens;
    truncate_prompt_tokens=k keeps the prompt's last k tokens. structured_outputs (vLLM's
    StructuredOutputsParams, or a dict of its fields) constrains the output to a JSON Schema, any JSON object, a
    regex, a choice or an EBNF grammar (replicas/grammar.py). bad_words (vLLM's) are never generated: a word's
    last token is banned wherever the output ends with the tokens before it. output_kind (vLLM's
    RequestOutputKind, or its int) chooses cumulative, delta or final-only outputs. Invalid values raise
    InvalidRequestError naming every field at fault.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | dict | None = None
    bad_words: list[str] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        problems: list[tuple[str, str]] = []

        def bad(name: str, need: str) -> None:
            problems.append((name, f"SamplingParams.{name} must be {need}, got {getattr(self, name)!r}"))

        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            bad("n", f"an integer in [1, {MAX_N}]")
        if not _is_num(self.temperature) or not self.temperature >= 0:
            bad("temperature", "a number >= 0 (0 = greedy)")
        if not _is_num(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "a number in (0, 1]")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (-1, 0)):
            bad("top_k", "-1 or 0 (off) or an integer >= 1")
        if not _is_num(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "a number in [0, 1]")
        if self.seed is not None and not _is_int(self.seed):
            bad("seed", "an integer or None")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "an integer >= 1")
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "a non-empty string or a list of non-empty strings")
        else:
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop_token_ids, (list, tuple, set)) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            bad("stop_token_ids", "a list of token ids >= 0")
        else:
            self.stop_token_ids = list(self.stop_token_ids)
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                bad(name, f"None or an integer in [0, {MAX_LOGPROBS}]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not -2 <= v <= 2:
                bad(name, "a number in [-2, 2]")
        if not _is_num(self.repetition_penalty) or not self.repetition_penalty > 0:
            bad("repetition_penalty", "a number > 0")
        if not _is_int(self.min_tokens) or self.min_tokens < 0 or (
                _is_int(self.max_tokens) and self.max_tokens >= 1 and self.min_tokens > self.max_tokens):
            bad("min_tokens", "an integer in [0, max_tokens]")
        if self.logit_bias is not None:
            bias = _token_bias(self.logit_bias)
            if bias is None:
                bad("logit_bias", f"a map of token ids (>= 0) to numbers in [-{MAX_BIAS}, {MAX_BIAS}]")
            else:
                self.logit_bias = bias
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids or not all(_is_int(t) and t >= 0 for t in ids):
                bad("allowed_token_ids", "None or a non-empty list of token ids >= 0")
            else:
                self.allowed_token_ids = list(ids)
        if self.bad_words is not None:
            words = self.bad_words
            if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in words):
                bad("bad_words", "None or a list of words (strings that are not blank)")
            else:
                self.bad_words = list(words)
        if self.truncate_prompt_tokens is not None and (
                not _is_int(self.truncate_prompt_tokens) or self.truncate_prompt_tokens < 1):
            bad("truncate_prompt_tokens", "None or an integer >= 1")
        try:
            self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)
        except InvalidRequestError as exc:
            problems += exc.problems
        if _is_int(self.output_kind) and self.output_kind in tuple(RequestOutputKind):
            self.output_kind = RequestOutputKind(self.output_kind)
            if self.output_kind is RequestOutputKind.DELTA and _is_int(self.n) and self.n > 1:
                bad("output_kind", "CUMULATIVE or FINAL_ONLY with n > 1 (DELTA outputs take one completion)")
        else:
            bad("output_kind", "a RequestOutputKind (0 CUMULATIVE, 1 DELTA, 2 FINAL_ONLY)")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "a bool")
        if problems:
            raise InvalidRequestError(problems)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def top_k_or_off(self) -> int:
        """top_k with 'off' normalised to 0."""
        return self.top_k if self.top_k > 0 else 0
