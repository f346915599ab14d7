"""Structured outputs in the engine: a compiled grammar per request, a matcher per sequence, masks per step.

xgrammar (the backend vLLM and SGLang default to) compiles a
StructuredOutputsParams against the tokenizer's vocabulary once. A matcher then
follows one sequence's tokens and fills, for its next step, a bitmask of the
tokens that keep the output inside the grammar (one bit a token, 32 to an
int32), in microseconds on the host, the step's rows in one call (xgrammar's
BatchGrammarMatcher). The engine fills a step's masks after launching the
step, so with async scheduling the GPU computes while the host fills; the
sampler applies them out of place (apply_token_masks).

xgrammar is imported on the first request that asks for structured outputs: a
replica that never sees one never pays for the import or for the scan of the
vocabulary (a second or more for a 128k-token one). The async engine compiles
a request's grammar on a worker thread before handing the request to the
engine's thread (compiled grammars are cached), so neither stalls the steps of
the requests already running.
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections.abc import Iterable
from typing import Any

import torch

from replicas.errors import InvalidRequestError
from replicas.structured_outputs import StructuredOutputsParams
from replicas.tokenizer import Tokenizer

# Compiled grammars kept for requests that repeat a schema (xgrammar's own cache, bounded by bytes).
COMPILE_CACHE_BYTES = 256 << 20
# Threads that fill one step's masks. xgrammar's BatchGrammarMatcher starts its threads on every call: with 8
# (its "auto" on 16 cores) an 8B step's 32 masks took 5 ms against 0.9 filled one by one (H100,
# bench/structured_outputs.py); one thread still saves the per-row Python calls.
FILL_THREADS = 1
# xgrammar's messages start with the C++ source position: "[12:00:01] /project/cpp/x.cc:83: ...".
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")


class SequenceGrammar:
    """One sequence's matcher: the tokens it accepted so far decide which may come next."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher  # xgrammar's GrammarMatcher

    def accept(self, token: int) -> bool:
        """Advance by the sampled token; False if the grammar does not allow it (the matcher is then unchanged)."""
        return bool(self.matcher.accept_token(token))

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: nothing may follow."""
        return bool(self.matcher.is_terminated())


class GrammarBackend:
    """Compiles requests' constraints for one tokenizer and model vocabulary (the logits' width)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler: Any = None
        self._batch: Any = None  # fills a step's masks in one call (FILL_THREADS)
        self._lock = threading.Lock()  # add_request may come from several threads (LLM, the async engine)

    def _xgrammar_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar
                    from transformers import PreTrainedTokenizerFast
                except ImportError as exc:
                    raise InvalidRequestError("structured outputs need the xgrammar package, which this server "
                                              f"does not have ({exc})", "structured_outputs") from exc
                # transformers' fast-tokenizer wrapper only hands xgrammar the vocabulary and the decoder's type
                # (byte-level, byte fallback, ...), which decide how each token's text is spelled.
                hf = PreTrainedTokenizerFast(tokenizer_object=self._tokenizer.backend)
                eos = self._tokenizer.eos_token_id
                info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                               stop_token_ids=None if eos is None else [eos])
                self._compiler = xgrammar.GrammarCompiler(info, cache_limit_bytes=COMPILE_CACHE_BYTES)
                self._batch = xgrammar.BatchGrammarMatcher(max_threads=FILL_THREADS)
            return self._compiler

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar; a schema, pattern or grammar that does not compile is the request's error."""
        compiler = self._xgrammar_compiler()
        try:
            if spec.kind in ("json", "json_object"):
                # OpenAI's JSON mode asks for an object (xgrammar's built-in JSON grammar takes any value)
                schema = spec.schema_text if spec.kind == "json" else '{"type": "object"}'
                return compiler.compile_json_schema(schema, any_whitespace=not spec.disable_any_whitespace)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.regex)
            if spec.kind == "choice":
                # each choice as an EBNF string literal; JSON's escapes are the ones xgrammar's EBNF reads
                return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec.choice))
            return compiler.compile_grammar(spec.grammar)
        except RuntimeError as exc:  # xgrammar reports every compile failure so
            reason = _SOURCE_PREFIX.sub("", str(exc).strip()).splitlines()[0]
            raise InvalidRequestError(f"structured_outputs.{spec.kind} cannot be compiled: {reason}",
                                      "structured_outputs") from exc

    def matcher(self, compiled: Any, stop_token_ids: Iterable[int]) -> SequenceGrammar:
        """A fresh matcher. Once the grammar is complete only stop_token_ids may follow (EOS and the request's
        stop ids): one of them ends the sequence, even under ignore_eos."""
        import xgrammar

        return SequenceGrammar(xgrammar.GrammarMatcher(compiled, override_stop_tokens=sorted(set(stop_token_ids))))

    def advance(self, steps: list[tuple[SequenceGrammar, int]]) -> list[bool]:
        """Each grammar takes its sequence's sampled token, all in one call; True where that ends the sequence
        (the grammar is complete and took a stop token, or, which masked sampling rules out, refused it)."""
        if not steps:
            return []
        import xgrammar

        grammars = [g for g, _ in steps]
        taken = xgrammar.BatchGrammarMatcher.batch_accept_token([g.matcher for g in grammars], [t for _, t in steps])
        return [not ok or g.is_terminated for g, ok in zip(grammars, taken)]

    def token_masks(self, grammars: list[SequenceGrammar | None], pin: bool) -> torch.Tensor | None:
        """The step's bitmask, [rows, ceil(vocab / 32)] int32 on the host (pinned for a non-blocking copy when
        pin): a row's allowed next tokens, all ones for a row with no grammar or a terminated one. None: no row
        has one."""
        live = [(row, g.matcher) for row, g in enumerate(grammars) if g is not None and not g.is_terminated]
        if not live:
            return None
        bitmask = torch.full((len(grammars), -(-self.vocab_size // 32)), -1, dtype=torch.int32, pin_memory=pin)
        rows, matchers = zip(*live)
        self._batch.batch_fill_next_token_bitmask(list(matchers), bitmask, list(rows))
        return bitmask


def apply_token_masks(logits: torch.Tensor, bitmask: torch.Tensor, fallback: torch.Tensor | None = None) -> torch.Tensor:
    """-inf on every token a row's bitmask leaves out. Out of place (logits may be a CUDA graph's buffer).

    fallback: the same rows before the request's other restrictions (min_tokens, allowed_token_ids). A row that
    the grammar and those together leave with no token takes the grammar's mask over fallback instead: the
    output keeps its shape, the other restriction yields (a grammar that is complete before min_tokens ends).
    """
    vocab = logits.shape[1]
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    words = bitmask.to(logits.device, non_blocking=True)
    allowed = ((words.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab]
    masked = logits.masked_fill(~allowed, -math.inf)
    if fallback is None:
        return masked
    dead = masked.amax(dim=-1, keepdim=True) == -math.inf
    return torch.where(dead, fallback.masked_fill(~allowed, -math.inf), masked)
