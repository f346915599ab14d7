"""Scheduler: continuous batching over a paged KV cache (pure Python, no torch).

Each step, running sequences go first (a decode token, or the next chunk of
an unfinished prefill), then waiting ones are admitted while the limits
allow: max_num_seqs sequences, max_num_batched_tokens tokens, and at most
max_loras distinct adapters among running sequences. A waiting request whose
adapter would need one slot too many is skipped, not waited on, so requests
behind it for the base model or an adapter already running go ahead; its
adapter is reported by adapters_to_prefetch() so the engine can load it early.
When the KV cache runs out, the most recently arrived running sequence is
preempted by recompute: its blocks are freed and it goes back to the front of
the queue, its outputs kept.

With policy "priority" (vLLM's scheduling_policy), every order above is by
(priority, arrival) instead of arrival alone, a lower priority value first:
the waiting queue is kept in that order (a preempted sequence goes back to
its place in it), and the sequence preempted is the running one that comes
last, the least urgent. Waiting requests never preempt running ones.

With policy "fair", admission follows the Virtual Token Counter (replicas/fairness.py): the next request
considered is the first waiting one of the tenant (its tenant key, else its adapter) served the fewest
weighted tokens so far, and the sequence preempted is the latest of the most-served tenant among those not
yet scheduled in the step. Every limit above, and the skipping, applies to the request considered as it
applies to the queue's head under "fcfs".

A sequence with a prefix_leader (a sibling of a parallel-sampling request) is
skipped the same way until its leader has computed the shared prompt: admitted
then, it finds the prompt's full blocks in the prefix cache, so n completions
compute their prompt once. Admitted in one step, each would compute it, since
the cache shares only blocks whose KV is already written.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from replicas.block_manager import BlockManager
from replicas.errors import InvalidRequestError
from replicas.fairness import VirtualTokenCounter
from replicas.sequence import Sequence, SequenceStatus


POLICIES = ("fcfs", "priority", "fair")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_loras: int = 4
    max_model_len: int | None = None  # prompt + output tokens a sequence may reach
    policy: str = "fcfs"  # or "priority": Sequence.priority first; "fair": tenants by VTC (module docstring)
    fair_prompt_weight: float = 1.0  # "fair": a tenant's charge per prompt token computed ...
    fair_output_weight: float = 2.0  # ... and per output token

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"SchedulerConfig.policy must be one of {POLICIES}, got {self.policy!r}")
        weights = (self.fair_prompt_weight, self.fair_output_weight)
        if not all(isinstance(w, (int, float)) and not isinstance(w, bool) and w >= 0 for w in weights) \
                or not any(weights):
            raise ValueError(f"fair_prompt_weight and fair_output_weight must be numbers >= 0, not both 0, "
                             f"got {weights}")
        for name, low in (("max_num_seqs", 1), ("max_num_batched_tokens", 1), ("max_loras", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or v < low:
                raise ValueError(f"SchedulerConfig.{name} must be an integer >= {low}, got {v!r}")


@dataclass(frozen=True)
class ScheduledSequence:
    """One sequence in a step: compute tokens [start, start + num_new_tokens).

    samples: the chunk reaches the end of the sequence, so the step samples a
    token for it. is_prefill: anything but a single decode token (a prompt
    chunk, or a resumed sequence recomputing its outputs).
    """

    seq: Sequence
    num_new_tokens: int
    start: int
    samples: bool
    is_prefill: bool

    @classmethod
    def of(cls, seq: Sequence, num_new_tokens: int) -> ScheduledSequence:
        start = seq.num_computed_tokens
        samples = start + num_new_tokens == seq.num_tokens
        is_decode = num_new_tokens == 1 and samples and seq.num_output_tokens > 0
        return cls(seq, num_new_tokens, start, samples, not is_decode)

    @property
    def token_ids(self) -> list[int]:
        # Slices, not all_token_ids: that copies the whole sequence, every step, for every sequence.
        prompt, outputs = self.seq.prompt_token_ids, self.seq.output_token_ids
        start, end, n = self.start, self.start + self.num_new_tokens, len(prompt)
        if start >= n:
            return outputs[start - n : end - n]
        return prompt[start:end] + outputs[: max(end - n, 0)]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)  # left since the previous step
    lora_ids: set[int] = field(default_factory=set)  # adapters the batch uses, 0 (base) excluded

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        adapter_ready: Callable[[int], bool] | None = None,
    ) -> None:
        """adapter_ready(lora_int_id) lets the engine hold back requests whose
        adapter is still loading; by default every adapter is ready."""
        self.config = config
        self.block_manager = block_manager
        self.adapter_ready = adapter_ready or (lambda _lora_id: True)
        self.pinned: set[int] = set()  # adapters holding a GPU slot for good (engine.pin_lora)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # kept in arrival order (by priority first under policy "priority")
        self.requests: dict[str, Sequence] = {}
        self._finished_since_step: list[Sequence] = []
        self._order: dict[str, int] = {}
        self._counter = 0
        self.fairness = (VirtualTokenCounter(config.fair_prompt_weight, config.fair_output_weight)
                         if config.policy == "fair" else None)

    # -- admission --------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a request; raises InvalidRequestError if it could never run."""
        if seq.request_id in self.requests:
            raise InvalidRequestError([("request_id", f"request_id {seq.request_id!r} is already in use")])
        if seq.num_prompt_tokens == 0:
            raise InvalidRequestError([("prompt", "the prompt is empty (0 tokens)")])
        max_len = self.config.max_model_len
        if max_len is not None and seq.num_prompt_tokens >= max_len:
            raise InvalidRequestError(
                [("prompt", f"the prompt has {seq.num_prompt_tokens} tokens; the model's context is {max_len}")]
            )
        bm = self.block_manager
        if bm.blocks_needed(seq.num_prompt_tokens + 1) > bm.num_blocks:
            raise InvalidRequestError(
                [("prompt", f"the prompt has {seq.num_prompt_tokens} tokens; the KV cache holds "
                  f"{bm.num_blocks * bm.block_size}")]
            )
        if seq.lora_int_id and self.config.max_loras == 0:
            raise InvalidRequestError([("lora_request", "LoRA is not enabled on this engine (max_loras=0)")])
        seq.status = SequenceStatus.WAITING
        self._order[seq.request_id] = self._counter
        self._counter += 1
        self.requests[seq.request_id] = seq
        if self.fairness is not None:
            self.fairness.arrive(seq)
        if self.config.policy == "priority":
            bisect.insort(self.waiting, seq, key=self._order_key)
        else:
            self.waiting.append(seq)

    def _order_key(self, seq: Sequence) -> tuple[int, float, int]:
        priority = seq.priority if self.config.policy == "priority" else 0
        return (priority, seq.arrival_time, self._order[seq.request_id])

    # -- queries ----------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def finished_since_step(self) -> list[Sequence]:
        """Sequences finished since the last schedule(), which reports them (read-only)."""
        return self._finished_since_step

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def running_lora_ids(self) -> set[int]:
        return {s.lora_int_id for s in self.running if s.lora_int_id}

    def adapters_to_prefetch(self, limit: int | None = None) -> list[int]:
        """Adapters of waiting requests that are not running yet, in arrival order."""
        running = self.running_lora_ids()
        out: list[int] = []
        for seq in self.waiting:
            lid = seq.lora_int_id
            if lid and lid not in running and lid not in out:
                out.append(lid)
                if limit is not None and len(out) >= limit:
                    break
        return out

    # -- one step ---------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            while not bm.can_append_slot(seq):
                # never one before i: it is in out.scheduled already
                victim = self.running[-1] if self.fairness is None else self.fairness.victim(self.running[i:])
                if victim is seq and len(self.running) == 1:
                    # Alone and still no room: the cache cannot hold it at all.
                    self.finish(seq, "length")
                    break
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # removed from running; the next one now sits at index i
            bm.append_slot(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            out.scheduled.append(ScheduledSequence.of(seq, n))
            budget -= n
            i += 1

        loras = self.running_lora_ids()
        if not out.preempted:
            self._admit(out, budget, loras)
        out.lora_ids = {s.seq.lora_int_id for s in out.scheduled if s.seq.lora_int_id}
        out.finished, self._finished_since_step = self._finished_since_step, []
        return out

    def _slot_free_for(self, lora_id: int, loras: set[int]) -> bool:
        """A pinned adapter has its slot; the others share the slots no pin holds."""
        if lora_id in self.pinned:
            return True
        return len(loras - self.pinned) < self.config.max_loras - len(self.pinned)

    def _admit(self, out: SchedulerOutput, budget: int, loras: set[int]) -> None:
        bm = self.block_manager
        skipped: list[Sequence] = []
        picks = self.fairness.admission_order(self.waiting) if self.fairness is not None else None
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            if picks is not None:  # the fair pick comes to the head; the rest is the same for every policy
                pick = next(picks)  # every pick not yet taken is still waiting: never exhausted here
                self.waiting.remove(pick)
                self.waiting.appendleft(pick)
            seq = self.waiting[0]
            lid = seq.lora_int_id
            if (lid and lid not in loras and (not self._slot_free_for(lid, loras) or not self.adapter_ready(lid))
                    or self._waits_for_leader(seq)):
                skipped.append(self.waiting.popleft())
                continue
            if not bm.can_allocate(seq):
                break  # memory is first come, first served: a long prompt is not starved
            self.waiting.popleft()
            bm.allocate(seq)
            if self.fairness is not None:
                self.fairness.admitted(seq)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=self._order_key)
            if lid:
                loras.add(lid)
            n = min(seq.num_uncomputed_tokens, budget)
            out.scheduled.append(ScheduledSequence.of(seq, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))

    @staticmethod
    def _waits_for_leader(seq: Sequence) -> bool:
        """Whether seq's prefix leader is still computing the prompt they share (then seq waits for its blocks).
        A leader that finished (stopped, aborted) lets it go too, with what the cache holds."""
        leader = seq.prefix_leader
        if leader is not None and not leader.is_finished and leader.num_computed_tokens < leader.num_prompt_tokens:
            return True
        seq.prefix_leader = None
        return False

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        if self.config.policy == "priority":  # back to its place: a more urgent request may be waiting
            bisect.insort(self.waiting, seq, key=self._order_key)
        else:
            self.waiting.appendleft(seq)

    # -- after the model step ---------------------------------------------
    def update_from_output(self, output: SchedulerOutput, sampled: Mapping[str, int]) -> list[Sequence]:
        """Record a step: advance computed tokens, append sampled tokens, finish
        on a stop token, EOS (unless ignore_eos), max_tokens or max_model_len.

        ``sampled`` maps request id -> token for the sequences whose chunk
        reached their end. Returns the sequences that finished in this call.
        Sequences aborted since the step was scheduled are skipped. A token
        may be PENDING_TOKEN (async scheduling): only the length limits apply
        then, and the engine checks the real token with token_stop() later.
        """
        finished: list[Sequence] = []
        for sched in output.scheduled:
            seq = sched.seq
            if seq.status is not SequenceStatus.RUNNING or seq.num_computed_tokens != sched.start:
                continue
            seq.num_computed_tokens += sched.num_new_tokens
            self.block_manager.cache_full_blocks(seq)
            if not sched.samples:
                continue
            token = sampled.get(seq.request_id)
            if token is None:
                raise KeyError(f"no sampled token for {seq.request_id!r}, whose prefill chunk reached its end")
            seq.append_token(token)
            if self.fairness is not None:
                self.fairness.generated(seq)
            reason, stop = self._check_stop(seq, token)
            if reason is not None:
                self.finish(seq, reason, stop)
                finished.append(seq)
        return finished

    @staticmethod
    def token_stop(seq: Sequence, token: int) -> tuple[str | None, int | None]:
        """("stop", stop_reason) if this sampled token ends seq (a stop token id, or EOS), else (None, None)."""
        params = seq.sampling_params
        if token in params.stop_token_ids:
            return "stop", token
        if not params.ignore_eos and token in seq.eos_token_ids:
            return "stop", None
        return None, None

    def _check_stop(self, seq: Sequence, token: int) -> tuple[str | None, int | None]:
        reason, stop = self.token_stop(seq, token)
        if reason is not None:
            return reason, stop
        params = seq.sampling_params
        if seq.num_output_tokens >= params.max_tokens:
            return "length", None
        if self.config.max_model_len is not None and seq.num_tokens >= self.config.max_model_len:
            return "length", None
        return None, None

    # -- leaving ----------------------------------------------------------
    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End a sequence ('stop', 'length' or 'abort'); frees its blocks. Idempotent."""
        if seq.is_finished or self.requests.get(seq.request_id) is not seq:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        else:
            self.waiting.remove(seq)
        seq.set_finished(reason, stop_reason)
        del self.requests[seq.request_id]
        del self._order[seq.request_id]
        if self.fairness is not None:
            self.fairness.leave(seq)
        self._finished_since_step.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        """Abort a waiting, preempted or running request; None if unknown or already done."""
        seq = self.requests.get(request_id)
        if seq is not None:
            self.finish(seq, "abort")
        return seq
