"""Sequence: one request's tokens and its progress through the scheduler. Pure Python."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable

from lora_core.request import LoRARequest
from replicas.sampling_params import SamplingParams
from replicas.seeded_noise import row_key


# An output token sampled by a step whose result has not been read back yet (async scheduling):
# it holds the token's place, so lengths, positions and max_tokens are right, until the engine
# writes the real id. Never fed to the model: the runner copies the sampled id on the device.
PENDING_TOKEN = -1

class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its KV cache dropped; recomputed on resume
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @classmethod
    def for_finish_reason(cls, reason: str) -> SequenceStatus:
        status = cls(reason)
        if status not in _FINISHED:
            raise ValueError(f"finish reason must be 'stop', 'length' or 'abort', got {reason!r}")
        return status


_FINISHED = frozenset(
    {SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_ABORTED}
)


class Sequence:
    """One request: prompt + generated tokens, adapter, sampling settings, cache state.

    num_computed_tokens counts tokens whose KV is in the cache; the next step
    computes tokens [num_computed_tokens, num_tokens). block_table lists the
    KV-cache blocks holding them, in order (owned by the BlockManager).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
        arrival_time: float | None = None,
        eos_token_ids: int | Iterable[int] | None = None,
        bad_words_ids: tuple[tuple[int, ...], ...] = (),
        priority: int = 0,
        tenant: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        self.lora_request = lora_request
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        if eos_token_ids is None:
            eos_token_ids = ()
        elif isinstance(eos_token_ids, int):
            eos_token_ids = (eos_token_ids,)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.bad_words_ids = bad_words_ids  # SamplingParams.bad_words as token sequences (request_inputs.py)
        self.priority = priority  # lower first, under the scheduler's "priority" policy
        self.tenant = tenant  # whose share it counts against under the "fair" policy; None: its adapter's

        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at the last admission
        self.num_preemptions = 0
        self.block_table: list[int] = []
        # A sibling sharing this prompt (parallel sampling): this one waits until the leader has computed
        # it, then takes its full blocks from the prefix cache instead of computing them again.
        self.prefix_leader: Sequence | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self._draws = 0  # random draws so far: with a seed, the next one's noise is row_key(seed, _draws)

    # -- tokens -----------------------------------------------------------
    @property
    def seq_id(self) -> str:
        return self.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(int(token_id))

    # -- adapter, status --------------------------------------------------
    @property
    def lora_int_id(self) -> int:
        """The adapter id, 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def set_finished(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = SequenceStatus.for_finish_reason(reason)
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def reset_for_recompute(self) -> None:
        """Forget the KV cache (preemption): prompt and outputs are prefilled again on resume.

        Outputs and the draw count are kept, so a seeded request's next draw
        has the noise it would have had without preemption.
        """
        self.num_computed_tokens = 0
        self.block_table = []
        self.status = SequenceStatus.PREEMPTED
        self.num_preemptions += 1

    # -- randomness -------------------------------------------------------
    def take_noise_key(self) -> int | None:
        """The noise key of this request's next random draw (replicas/seeded_noise.py), None when no seed was
        given; each call is a draw."""
        seed = self.sampling_params.seed
        if seed is None:
            return None
        self._draws += 1
        return row_key(seed, self._draws - 1)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, lora={self.lora_int_id}, status={self.status.name}, "
            f"tokens={self.num_prompt_tokens}+{self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
