"""SampledStep: a step whose tokens were sampled on the device, and what reading them back needs.

The engine (replicas/engine.py) samples each step on the device and, with async scheduling, launches the next
step before it reads these tokens back: the pinned host copy and its event let the read-back wait for the
copy alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from replicas.sampler import SamplerOutput
from replicas.scheduler import SchedulerOutput
from replicas.sequence import Sequence


@dataclass
class SampledStep:
    """A step whose tokens were sampled on the device: what reading them back needs."""

    out: SchedulerOutput
    samplers: list[Sequence]  # row i of sampled.token_ids samples for samplers[i]
    sampled: SamplerOutput
    host_tokens: torch.Tensor | None = None  # CUDA: pinned copy of the tokens, valid once `ready` fired
    ready: torch.cuda.Event | None = None
    pending: list[tuple[Sequence, int, int]] = field(default_factory=list)  # (seq, output index, row)

    @property
    def rows(self) -> dict[str, int]:
        return {seq.request_id: i for i, seq in enumerate(self.samplers)}

    def tokens(self) -> list[int]:
        if self.ready is None:
            return self.sampled.token_ids.tolist()
        self.ready.synchronize()
        return self.host_tokens.tolist()
