"""Prompt logprobs (SamplingParams.prompt_logprobs, vLLM's): each prompt token's logprob under the model, with
the top-k of its position, as the prefill computes them.

The logits at prompt position p predict token p + 1, so a prefill chunk over positions [start, start + n)
gives the entries of tokens start + 1 .. start + n that are in the prompt (the last prompt position's logits
are the sampled row's). The runner computes logits for these rows after the sampled ones
(StepInput.prompt_logprob_rows); recording them reads them back to the host, a sync that only steps holding
such rows pay. A request asking for them computes its whole prompt: prefix caching would leave the cached
positions without logits (block_manager.py). Entry 0 (the first token, which nothing predicts) is None, as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence as Seq

import torch

from replicas.model_runner import StepInput
from replicas.scheduler import ScheduledSequence
from replicas.sequence import Sequence
from replicas.token_logprobs import token_logprobs


@dataclass
class PromptRows:
    seq: Sequence
    first: int  # prompt position of the span's first row (it predicts token first + 1)
    row: int  # that row's index among the step's prompt-logprob rows
    count: int


def plan(scheduled: Seq[ScheduledSequence]) -> tuple[list[int], list[PromptRows]]:
    """(input rows whose logits give prompt logprobs, their spans) for a step's sequences laid end to end."""
    rows: list[int] = []
    spans: list[PromptRows] = []
    offset = 0
    for s in scheduled:
        seq = s.seq
        end = min(s.start + s.num_new_tokens, seq.num_prompt_tokens - 1)
        if seq.sampling_params.prompt_logprobs is not None and s.start < end:
            spans.append(PromptRows(seq, s.start, len(rows), end - s.start))
            rows += range(offset, offset + end - s.start)
        offset += s.num_new_tokens
    return rows, spans


def record(logits: torch.Tensor, spans: Seq[PromptRows], entries: Callable[[Sequence], list | None]) -> None:
    """logits [len(rows), vocab]: each span's entries ({token: logprob} of the prompt token and its position's
    top-k) appended to entries(seq), a list whose length is the next prompt token's index; entries a preempted
    sequence computes again are not appended twice. The rows go through token_logprobs (no [rows, vocab]
    log_softmax: a 2,048-token chunk's would take another GiB) and come back in one copy."""
    targets = [t for span in spans for t in span.seq.prompt_token_ids[span.first + 1: span.first + 1 + span.count]]
    ks = [span.seq.sampling_params.prompt_logprobs for span in spans]
    k = max(ks)
    rows = token_logprobs(logits, torch.tensor(targets, device=logits.device), k).tolist()
    for span, kk in zip(spans, ks):
        out = entries(span.seq)
        if out is None:
            continue
        for j, (token, logprob, _rank, *tops) in enumerate(rows[span.row: span.row + span.count]):
            if span.first + 1 + j == len(out):
                entry = {int(t): v for t, v in zip(tops[k: k + kk], tops[:kk])}
                entry[int(token)] = logprob
                out.append(entry)


def execute(executor: Any, step: StepInput, previous_tokens: torch.Tensor | None, scheduled: Seq[ScheduledSequence],
            entries: Callable[[Sequence], list | None]) -> torch.Tensor:
    """Run the step with its prompt-logprob rows, record them, return the sampled rows' logits."""
    spans: list[PromptRows] = []
    if step.is_prefill:  # only prompt chunks give prompt logprobs: decode steps skip the look
        step.prompt_logprob_rows, spans = plan(scheduled)
    logits = executor.execute(step, previous_tokens)
    if not spans:
        return logits
    sampled = len(step.sample_rows)  # the prompt rows come after the sampled ones
    record(logits[sampled:], spans, entries)
    return logits[:sampled]
