"""What the engine returns, shaped like vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None  # per generated token: {token id: logprob}
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    lora_name: str | None = None
    error: Exception | None = None  # set when this request failed; the engine kept serving the others
    # SamplingParams.prompt_logprobs: per prompt token {token: logprob} (None for the first), else None
    prompt_logprobs: list[dict[int, float] | None] | None = None


class CompletionDeltas:
    """What each completion of one request gained since the last call, from its cumulative RequestOutputs (for
    streaming APIs): calling it with an output yields (completion, new text, new token ids, last) for every
    completion with news, last being its final report (finish_reason set); nothing more of it after that."""

    def __init__(self) -> None:
        self._sent: dict[int, tuple[int, int]] = {}  # per completion index: text and token ids reported
        self._done: set[int] = set()

    def __call__(self, out: RequestOutput) -> Iterator[tuple[CompletionOutput, str, list[int], bool]]:
        for c in out.outputs:
            if c.index in self._done:
                continue
            text_at, ids_at = self._sent.get(c.index, (0, 0))
            text, ids, last = c.text[text_at:], list(c.token_ids[ids_at:]), c.finish_reason is not None
            if not text and not ids and not last:
                continue
            self._sent[c.index] = len(c.text), len(c.token_ids)
            if last:
                self._done.add(c.index)
            yield c, text, ids, last
