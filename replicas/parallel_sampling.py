"""Parallel sampling (SamplingParams.n > 1): one request, n completions, as OpenAI's `n` and vLLM's.

A request with n > 1 runs as n child sequences of n = 1, scheduled like any others (one adapter load serves
them all; with prefix caching the later children wait until the first has computed the prompt, then share
its blocks: scheduler.py), and reports as one RequestOutput whose outputs are the n completions, index
0..n-1. With a seed, child i samples with seed + i, so the n completions differ and the request is
reproducible; greedy children agree.

FanOut keeps the parents: the engine adds the children (child_id, child_params), passes every step's outputs
through merge (one output per parent touched by the step, in place of its children's), and aborts a
parent's children with it. A child that fails (its adapter did not load) fails the parent: the other
children are aborted and their later outputs dropped.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

from replicas.outputs import CompletionOutput, RequestOutput
from replicas.sampling_params import SamplingParams


def child_id(request_id: str, index: int) -> str:
    return f"{request_id}#{index}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Child index's settings: n = 1, seed + index; prompt logprobs for the first only (the request reports
    one list, and the others may then share the first's prompt blocks)."""
    seed = None if params.seed is None else params.seed + index
    prompt_logprobs = params.prompt_logprobs if index == 0 else None
    return dataclasses.replace(params, n=1, seed=seed, prompt_logprobs=prompt_logprobs)


@dataclass
class _Parent:
    request_id: str
    n: int
    latest: dict[int, CompletionOutput] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)
    first: RequestOutput | None = None  # a child's output: the prompt, its ids and the adapter's name
    final_only: bool = False  # output_kind FINAL_ONLY: the parent reports once, when its last child finishes

    def absorb(self, index: int, out: RequestOutput) -> None:
        self.latest[index] = dataclasses.replace(out.outputs[0], index=index)
        self.first = self.first or out
        if out.finished:
            self.finished.add(index)

    def output(self, error: Exception | None = None) -> RequestOutput:
        first = self.first
        outputs = [self.latest.get(i) or CompletionOutput(i, "", [], None, None) for i in range(self.n)]
        return RequestOutput(self.request_id, first.prompt, first.prompt_token_ids, outputs,
                             error is not None or len(self.finished) == self.n, first.lora_name, error,
                             first.prompt_logprobs)


class FanOut:
    def __init__(self) -> None:
        self._parents: dict[str, _Parent] = {}
        self._children: dict[str, tuple[_Parent, int]] = {}
        self._dropped: set[str] = set()  # children of a failed parent, aborted: their last outputs are not news

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._parents

    def add(self, request_id: str, n: int, final_only: bool = False) -> None:
        """A parent of n children, child_id(request_id, i): the engine adds them."""
        parent = _Parent(request_id, n, final_only=final_only)
        self._parents[request_id] = parent
        for i in range(n):
            self._children[child_id(request_id, i)] = (parent, i)

    def children(self, request_id: str) -> list[str]:
        parent = self._parents.get(request_id)
        return [child_id(request_id, i) for i in range(parent.n)] if parent is not None else []

    def merge(self, outputs: list[RequestOutput], abort: Callable[[str], object]) -> list[RequestOutput]:
        """outputs with each parent's children replaced by one output of the parent (after the last of them);
        abort(child id) stops the siblings of a failed child."""
        merged: list[RequestOutput] = []
        touched: dict[str, _Parent] = {}
        for out in outputs:
            owner = self._children.pop(out.request_id, None) if out.finished else self._children.get(out.request_id)
            if owner is None:
                if out.request_id not in self._dropped:
                    merged.append(out)
                elif out.finished:
                    self._dropped.discard(out.request_id)
                continue
            parent, index = owner
            if parent.request_id not in self._parents:
                continue  # the parent failed earlier this step
            parent.absorb(index, out)
            if out.error is not None:
                self._fail(parent, abort)
                merged.append(parent.output(out.error))
                touched.pop(parent.request_id, None)
            else:
                touched[parent.request_id] = parent
        for parent in touched.values():
            out = parent.output()
            if out.finished:
                del self._parents[parent.request_id]
            if out.finished or not parent.final_only:
                merged.append(out)
        return merged

    def _fail(self, parent: _Parent, abort: Callable[[str], object]) -> None:
        del self._parents[parent.request_id]
        for i in range(parent.n):
            cid = child_id(parent.request_id, i)
            if self._children.pop(cid, None) is not None and i not in parent.finished:
                self._dropped.add(cid)
                abort(cid)
