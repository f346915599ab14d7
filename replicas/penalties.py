"""Presence, frequency and repetition penalties, from token counts that stay on the logits' device.

The definition (penalize_reference, as vLLM and HF apply them): repetition divides a positive logit by r and
multiplies a negative one by r for every token the prompt or the outputs hold; then each logit loses
frequency x (times the outputs hold it) and presence x (whether they hold it at all).

Built from the host's lists at every step, that costs the host more than a small model's decode step takes:
every output id of every row through numpy and to the device, a [rows, vocab] count from zero, each row's
prompt mask stacked, a dozen torch launches (0.9 ms of host time at 32 rows x 128 K, a 1B model's step
1.75 -> 4.4 ms). PenaltyState keeps a slot per
sequence instead: a row of output counts and one of prompt tokens, filled from the host once and then
advanced on the device by each token the sampler draws for it (record). A step costs one copy of the rows'
settings and a launch (replicas/kernels/penalties.py on CUDA).

The host's lists stay the truth: a slot is trusted only while its sequence holds as many outputs as the
state expects (those it was filled from, plus one per draw since); anything else (a sequence new to the
state, outputs that changed under it) refills the slot from the lists. The engine appends exactly the token
drawn, and reads each step's tokens back before the next draw, so in serving a slot is filled once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence as Seq

import numpy as np
import torch

from replicas.sampling_params import SamplingParams
from replicas.sequence import Sequence

SETTINGS = 4  # a row's [slot (-1: no penalty), repetition, frequency, presence], in one float32 copy


def penalize_reference(logits: torch.Tensor, seqs: Seq[Sequence], params: Seq[SamplingParams]) -> torch.Tensor:
    """logits [N, V] -> new penalized logits: the definition above, from the sequences' lists (PENDING
    placeholders and ids outside the vocabulary skipped)."""
    n, vocab = logits.shape
    counts = torch.zeros(n, vocab, dtype=logits.dtype)
    prompt = torch.zeros(n, vocab, dtype=torch.bool)
    for i, seq in enumerate(seqs):
        counts[i] = torch.bincount(_ids(seq.output_token_ids, vocab), minlength=vocab).to(logits.dtype)
        prompt[i, _ids(seq.prompt_token_ids, vocab)] = True
    counts, prompt = counts.to(logits.device), prompt.to(logits.device)
    rep, freq, presence = (torch.tensor([getattr(p, f) for p in params], dtype=logits.dtype,
                                        device=logits.device).unsqueeze(1)
                           for f in ("repetition_penalty", "frequency_penalty", "presence_penalty"))
    return _penalize(logits, counts, prompt, rep, freq, presence)


def _penalize(logits, counts, prompt, rep, freq, presence) -> torch.Tensor:
    """The arithmetic, shared by the reference and the CPU path (the kernel does it in this order too)."""
    seen = prompt | (counts > 0)
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - freq * counts - presence * (counts > 0).to(logits.dtype)


def _ids(ids: list[int], vocab: int) -> torch.Tensor:
    arr = np.asarray(ids, dtype=np.int64)
    return torch.from_numpy(arr[(arr >= 0) & (arr < vocab)])


@dataclass
class _Slot:
    seq: Sequence
    index: int
    expected: int  # outputs the sequence holds while the slot is right; -1: not filled yet


@dataclass
class PenaltyDraw:
    """One apply's rows, for record: the settings on the device and the slots drawn for."""
    settings: torch.Tensor  # [N, SETTINGS] float32 on the logits' device
    slots: list[_Slot]
    rows: list[int]


class PenaltyState:
    """The slots of one sampler: [capacity, V] float32 output counts and uint8 prompt tokens on one device.

    Capacity grows (doubling) only when a step's penalized rows alone need more slots; otherwise a new
    sequence takes a free slot, a finished sequence's, or one of a sequence outside the step (refilled
    should it come back). So it stays within the largest step's rows: at 256 rows x 128 K, 164 MB.
    """

    def __init__(self) -> None:
        self._owners: dict[int, _Slot] = {}  # id(sequence) -> its slot
        self._free: list[int] = []
        self.counts: torch.Tensor | None = None
        self.prompt: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        return 0 if self.counts is None else self.counts.shape[0]

    def apply(self, logits: torch.Tensor, seqs: Seq[Sequence], params: Seq[SamplingParams]
              ) -> tuple[torch.Tensor, PenaltyDraw]:
        """logits [N, V] (float32) -> (new penalized logits, the draw to record once tokens are drawn)."""
        n, vocab = logits.shape
        if self.counts is None or self.counts.shape[1] != vocab or self.counts.device != logits.device:
            self._reset(vocab, logits.device)
        rows = [i for i, p in enumerate(params) if p.has_penalties]
        slots = self._slots([seqs[i] for i in rows])
        table = np.zeros((n, SETTINGS), dtype=np.float32)
        table[:, 0], table[:, 1] = -1.0, 1.0
        for i, slot in zip(rows, slots):
            p = params[i]
            table[i] = (slot.index, p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
        settings = _to(torch.from_numpy(table), logits.device)
        if logits.is_cuda:
            from replicas.kernels.penalties import penalize  # triton: CUDA only here

            out = penalize(logits, self.counts, self.prompt, settings)
        else:
            out = self._penalize_rows(logits, rows, slots, settings)
        return out, PenaltyDraw(settings, slots, rows)

    def record(self, draw: PenaltyDraw, token_ids: torch.Tensor) -> None:
        """Count each penalized row's drawn token in its slot (on the device: nothing waits for the draw)."""
        if not draw.rows:
            return
        if token_ids.is_cuda:
            from replicas.kernels.penalties import record

            record(self.counts, draw.settings, token_ids)
        else:
            index = torch.tensor([s.index for s in draw.slots])
            self.counts.index_put_((index, token_ids[draw.rows]), torch.ones(len(index)), accumulate=True)
        for slot in draw.slots:
            slot.expected = slot.seq.num_output_tokens + 1

    # -- slots -------------------------------------------------------------------------------------
    def _slots(self, seqs: list[Sequence]) -> list[_Slot]:
        in_step = {id(s) for s in seqs}
        slots, stale = [], []
        for seq in seqs:
            slot = self._owners.get(id(seq))
            if slot is None or slot.seq is not seq:
                slot = self._owners[id(seq)] = _Slot(seq, self._take(in_step), -1)
            if slot.expected != seq.num_output_tokens:
                stale.append(slot)
            slots.append(slot)
        if stale:
            self._fill(stale)
        return slots

    def _take(self, in_step: set[int]) -> int:
        if not self._free:  # finished sequences first, then those outside this step
            for key in [k for k, s in self._owners.items() if s.seq.is_finished] or \
                       [k for k in self._owners if k not in in_step]:
                self._free.append(self._owners.pop(key).index)
        if not self._free:
            self._grow(max(8, 2 * self.capacity))
        return self._free.pop()

    def _fill(self, slots: list[_Slot]) -> None:
        """The slots' rows from their sequences' lists: one copy of every id, two scatters."""
        vocab, device = self.counts.shape[1], self.counts.device
        index = torch.tensor([s.index for s in slots])
        outputs = [_ids(s.seq.output_token_ids, vocab) + s.index * vocab for s in slots]
        prompts = [_ids(s.seq.prompt_token_ids, vocab) + s.index * vocab for s in slots]
        flat = _to(torch.cat(outputs + prompts), device)
        split = sum(len(o) for o in outputs)
        self.counts.index_fill_(0, _to(index, device), 0.0)
        self.prompt.index_fill_(0, _to(index, device), 0)
        self.counts.view(-1).index_put_((flat[:split],), torch.ones(split, device=device), accumulate=True)
        marks = flat[split:]
        self.prompt.view(-1).index_put_((marks,), torch.ones(len(marks), dtype=torch.uint8, device=device))
        for slot in slots:
            slot.expected = slot.seq.num_output_tokens

    def _grow(self, capacity: int) -> None:
        old = self.capacity
        counts = torch.zeros(capacity, self.counts.shape[1], dtype=torch.float32, device=self.counts.device)
        prompt = torch.zeros(capacity, self.counts.shape[1], dtype=torch.uint8, device=self.counts.device)
        counts[:old], prompt[:old] = self.counts, self.prompt
        self.counts, self.prompt = counts, prompt
        self._free += range(capacity - 1, old - 1, -1)

    def _reset(self, vocab: int, device: torch.device) -> None:
        self._owners.clear()
        self._free = []
        self.counts = torch.zeros(0, vocab, dtype=torch.float32, device=device)
        self.prompt = torch.zeros(0, vocab, dtype=torch.uint8, device=device)

    def _penalize_rows(self, logits: torch.Tensor, rows: list[int], slots: list[_Slot],
                       settings: torch.Tensor) -> torch.Tensor:
        """The CPU path: the penalized rows' slots through the reference's arithmetic."""
        index = torch.tensor([s.index for s in slots])
        every = len(rows) == logits.shape[0]  # rows are then 0..N-1: no gather, no scatter
        columns = (settings[:, 1:] if every else settings[rows, 1:]).unsqueeze(2)  # [rows, 3, 1]
        out = _penalize(logits if every else logits[rows], self.counts[index], self.prompt[index].bool(),
                        *columns.unbind(1))
        if every:
            return out
        whole = logits.clone()
        whole[rows] = out
        return whole


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    # pinned and non-blocking on CUDA: a copy from pageable memory first waits for every queued kernel
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)
