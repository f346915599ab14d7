"""SampledStep: a step whose tokens were sampled on the device, and what reading them back needs.

The engine (replicas/engine.py) samples each step on the device and, with async scheduling, launches the next
step before it reads these tokens back: the pinned host copy and its event let the read-back wait for the
copy alone, and step_input builds the next step's inputs with those tokens still on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from replicas.rope_config import LONG_ROPE
from replicas.model_runner import StepInput
from replicas.sampler import SamplerOutput
from replicas.scheduler import SchedulerOutput
from replicas.sequence import PENDING_TOKEN, Sequence


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


def step_input(out: SchedulerOutput, previous: SampledStep | None,
               long_rope_from: int | None = None) -> tuple[StepInput, torch.Tensor | None]:
    """A scheduled step's inputs, and the previous step's device tokens when some inputs are still pending
    (async scheduling: the runner copies them into place on the device).

    long_rope_from (ModelConfig.long_rope_from): the positions below it of a sequence whose prompt is longer
    go in as p + LONG_ROPE, which the rotary embedding turns with longrope's long factors, as transformers
    turns such a prompt. Only prompt tokens lie there (a decode token's position is past its prompt), so a
    decode step's positions, which address its KV slots, are never encoded."""
    step = StepInput([], [], [], [], [], [], [], [], is_prefill=any(s.is_prefill for s in out.scheduled))
    rows = previous.rows if previous is not None else {}
    for s in out.scheduled:
        seq = s.seq
        step.sample_rows += [len(step.input_ids) + s.num_new_tokens - 1] if s.samples else []
        ids = s.token_ids
        if ids[-1] == PENDING_TOKEN:  # only a sequence's newest token can be pending
            step.fill_rows.append(len(step.input_ids) + len(ids) - 1)
            step.fill_from.append(rows[seq.request_id])
            ids[-1] = 0
        step.input_ids += ids
        if long_rope_from is not None and s.start < long_rope_from < seq.num_prompt_tokens:
            step.positions += [p + LONG_ROPE if p < long_rope_from else p
                               for p in range(s.start, s.start + s.num_new_tokens)]
        else:
            step.positions += list(range(s.start, s.start + s.num_new_tokens))
        step.query_lens.append(s.num_new_tokens)
        step.seq_lens.append(s.start + s.num_new_tokens)
        step.block_tables.append(list(seq.block_table))
        step.token_lora_ids += [seq.lora_int_id] * s.num_new_tokens
        step.sample_lora_ids += [seq.lora_int_id] if s.samples else []
    return step, previous.sampled.token_ids if step.fill_rows else None
