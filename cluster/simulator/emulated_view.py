"""What LoRAServer reads of an EmulatedEngine's `engine` (an LLMEngine's attributes): rank 0's runner with its LoRA
manager (slot ids, host-cache ids, adapter memory), the scheduler's counts, the tokenizer and max_model_len, all
answered from the emulated replica (cluster/simulator/emulated.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from replicas.errors import InvalidRequestError

if TYPE_CHECKING:
    from cluster.simulator.emulated import EmulatedEngine


class EngineView:
    """The LLMEngine attributes LoRAServer reads (`engine.engine`): rank 0's runner with its LoRA manager, the
    scheduler's counts, the tokenizer and max_model_len, all answered from the emulated replica."""

    def __init__(self, emulated: EmulatedEngine, tokenizer: Callable[[], Any] | None) -> None:
        self._emulated = emulated
        self._load_tokenizer, self._tokenizer = tokenizer, None
        self.executor = _Executor(_Runner(_Manager(emulated)))
        self.scheduler = _Scheduler(emulated)
        self.max_model_len = emulated.args.max_model_len or 1 << 20  # no context limit is modeled

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            if self._load_tokenizer is None:
                raise InvalidRequestError([("prompt", "this emulated engine takes prompt_token_ids only")])
            self._tokenizer = self._load_tokenizer()
        return self._tokenizer


@dataclass
class _Executor:
    runner: "_Runner"


@dataclass
class _Loads:
    worker_restarts: int = 0


class _Runner:
    def __init__(self, manager: "_Manager") -> None:
        self.lora_manager = manager
        self.loads = _Loads()

    def lora_merge_state(self) -> tuple[int | None, int]:
        return None, 0  # a lone adapter's merge is in the step model's cost, not emulated as a state


class _Manager:
    """LoRAModelManager's read side: slot -> adapter id, the host cache's ids, adapter memory."""

    def __init__(self, emulated: EmulatedEngine) -> None:
        self._e = emulated

    def _id(self, name: str) -> int:
        return self._e.adapters[name].lora_int_id

    @property
    def lora_index_to_id(self) -> list[int | None]:
        replica = self._e.replica
        ids = [self._id(a) for a in replica.slots if a in self._e.adapters] if replica else []
        return ids + [None] * (self._e.config.max_loras - len(ids))

    def list_adapters(self) -> list[int]:
        replica = self._e.replica
        return [self._id(a) for a in replica.host if a in self._e.adapters] if replica else []

    def memory_bytes(self) -> dict[str, int]:
        per = int(self._e.model.adapter_bytes(self._e.emulation.rank))
        replica = self._e.replica
        return {"gpu_reserved": self._e.config.max_loras * per,
                "gpu_used": (len(replica.slots) if replica else 0) * per,
                "host": (len(replica.host) if replica else 0) * per}


class _Scheduler:
    def __init__(self, emulated: EmulatedEngine) -> None:
        self._e = emulated

    @property
    def num_running(self) -> int:
        return len(self._e.replica.running) if self._e.replica else 0

    @property
    def num_waiting(self) -> int:
        return len(self._e.replica.waiting) if self._e.replica else 0
