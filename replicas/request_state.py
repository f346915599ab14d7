"""RequestState: what the engine keeps of one sequence besides the Sequence itself, and its RequestOutput.

The scheduler's Sequence holds tokens and status; this holds what only the outputs need (the prompt's text,
the detokenizer, the logprobs so far, the grammar that constrains the sequence) and builds the cumulative
RequestOutput the engine reports after each step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from replicas.grammar import SequenceGrammar
from replicas.outputs import CompletionOutput, RequestOutput
from replicas.sampling_params import RequestOutputKind
from replicas.sequence import Sequence
from replicas.tokenizer import IncrementalDetokenizer


@dataclass
class RequestState:
    seq: Sequence
    prompt: str | None
    detok: IncrementalDetokenizer
    lora_name: str | None
    logprobs: list[dict[int, float]] | None = field(default=None)
    # The prompt's ids as every output reports them: copied once, not per step (a long prompt's copy,
    # for every running request at every step, adds up to milliseconds of host time).
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # filled as the prefill goes (prompt_logprobs.py)
    grammar: SequenceGrammar | None = None  # SamplingParams.structured_outputs (replicas/grammar.py)
    # DELTA outputs: how many tokens and characters of text earlier outputs carried
    sent_tokens: int = 0
    sent_text: int = 0

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.seq.prompt_token_ids)
        if self.seq.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    def output(self) -> RequestOutput:
        """The request's output so far (finished once its sequence is); with output_kind DELTA, what is new
        since the previous one (the prompt's fields in every one)."""
        seq = self.seq
        if seq.is_finished and not self.detok.stopped:
            self.detok.finish()
        start, text_start = 0, 0
        if seq.sampling_params.output_kind is RequestOutputKind.DELTA:
            start, text_start = self.sent_tokens, self.sent_text
            self.sent_tokens, self.sent_text = seq.num_output_tokens, len(self.detok.text)
        # slices: copies the consumer owns, as the engine appends to its lists in place
        logprobs = self.logprobs[start:] if self.logprobs is not None else None
        completion = CompletionOutput(0, self.detok.text[text_start:], seq.output_token_ids[start:], logprobs,
                                      seq.finish_reason, seq.stop_reason)
        return RequestOutput(seq.request_id, self.prompt, self.prompt_token_ids, [completion],
                             seq.is_finished, self.lora_name, prompt_logprobs=self.prompt_logprobs)

    def failed(self, error: Exception) -> RequestOutput:
        """The request's only output, when it cannot run at all (its adapter failed to load)."""
        return RequestOutput(self.seq.request_id, self.prompt, list(self.seq.prompt_token_ids),
                             [CompletionOutput(0, "", [], None, "error")], True, self.lora_name, error)
