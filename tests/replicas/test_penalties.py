"""PenaltyState (counts kept on the device between steps) against penalize_reference (the host's lists every
step), bit for bit: through steps where rows join, leave, finish and come back, outputs change under the
state, and the slots run out; and the Triton kernels against the torch path (interpreter here, CUDA on a GPU).
"""

from __future__ import annotations

import random

import pytest
import torch

from replicas.penalties import PenaltyState, penalize_reference
from replicas.sampling_params import SamplingParams
from replicas.sequence import PENDING_TOKEN, Sequence, SequenceStatus
from tests.replicas.engine_cases import PROMPTS, make_llm, run_steps, seeded, submit  # noqa: F401  (fixture)

VOCAB = 300
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _params(rng: random.Random) -> SamplingParams:
    kind = rng.randrange(5)
    if kind == 0:
        return SamplingParams()  # no penalty: rows the state must leave alone
    return SamplingParams(repetition_penalty=rng.choice([1.0, 1.3, 0.8]) if kind != 1 else 1.0,
                          frequency_penalty=rng.choice([0.0, 0.5, -0.25]),
                          presence_penalty=rng.choice([0.0, 1.0, 0.3]) if kind != 2 else 0.7)


def _sequence(rng: random.Random, name: str) -> Sequence:
    prompt = [rng.randrange(VOCAB + 20) for _ in range(rng.randrange(1, 40))]  # some ids past the vocabulary
    return Sequence(name, prompt, _params(rng))


def _logits(rng: random.Random, n: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    logits = torch.randn(n, VOCAB, generator=g) * 3
    logits[:, :5] = torch.tensor([0.0, -0.0, float("-inf"), 4.0, -4.0])  # signs and a banned token
    return logits.to(device)


def _count_fills(state: PenaltyState) -> list[int]:
    """The number of slots each of the state's refills from the host's lists takes, from now on."""
    fills: list[int] = []
    real_fill = state._fill
    state._fill = lambda slots: (fills.append(len(slots)), real_fill(slots))
    return fills


def _check(state: PenaltyState, logits: torch.Tensor, batch: list[Sequence]) -> torch.Tensor:
    params = [s.sampling_params for s in batch]
    got, draw = state.apply(logits, batch, params)
    want = penalize_reference(logits, batch, params)
    assert torch.equal(got.cpu(), want.cpu())
    return draw


def _draw(state: PenaltyState, batch: list[Sequence], rng: random.Random, device: str) -> None:
    """One step as the engine takes it: penalties checked against the reference, the argmax drawn, recorded
    and appended to each sequence."""
    logits = _logits(rng, len(batch), device)
    draw = _check(state, logits, batch)
    tokens = logits.argmax(-1)
    state.record(draw, tokens)
    for seq, token in zip(batch, tokens.tolist()):
        seq.append_token(token)


@pytest.mark.parametrize("device", DEVICES)
def test_steps_of_a_changing_batch_match_the_reference(device):
    rng = random.Random(0)
    state = PenaltyState()
    alive = [_sequence(rng, f"s{i}") for i in range(6)]
    made, refills = 6, 0
    for step in range(40):
        batch = [s for s in alive if rng.random() < 0.8] or alive[:1]  # some rows sit a step out
        _draw(state, batch, rng, device)
        if step % 7 == 3:  # outputs change under the state: a token the state did not draw, and a placeholder
            alive[0].append_token(rng.randrange(VOCAB))
            alive[1].output_token_ids.append(PENDING_TOKEN)
            refills += 2
        if step % 5 == 4:  # one finishes, a new one joins
            alive.pop(rng.randrange(len(alive))).status = SequenceStatus.FINISHED_STOPPED
            alive.append(_sequence(rng, f"s{made}"))
            made += 1
    assert refills and state.capacity == 8  # finished sequences' slots were reused, not added to


@pytest.mark.parametrize("device", DEVICES)
def test_slots_of_sequences_outside_the_step_are_lent_out_and_refilled(device):
    """More live penalized sequences than slots: a step takes slots of those outside it; they come back
    with their counts rebuilt from their lists."""
    rng = random.Random(1)
    state = PenaltyState()
    seqs = [Sequence(f"s{i}", [i, i + 1], SamplingParams(frequency_penalty=0.5, repetition_penalty=1.2))
            for i in range(12)]
    for step in range(6):
        _draw(state, seqs[:8] if step % 2 == 0 else seqs[4:], rng, device)
    assert state.capacity == 8


@pytest.mark.parametrize("device", DEVICES)
def test_a_step_larger_than_the_slots_grows_them(device):
    rng = random.Random(2)
    state = PenaltyState()
    seqs = [Sequence(f"s{i}", [3], SamplingParams(presence_penalty=1.0)) for i in range(20)]
    for seq in seqs:
        seq.append_token(rng.randrange(VOCAB))
    _check(state, _logits(rng, 5, device), seqs[:5])
    _check(state, _logits(rng, 20, device), seqs)
    assert state.capacity == 32


def test_the_kernels_equal_the_torch_path():
    """Under the interpreter here (CUDA on a GPU): penalize on strided logits rows, record into slots."""
    from replicas.kernels import penalties as kernels

    device = DEVICES[-1]
    rng = random.Random(3)
    g = torch.Generator().manual_seed(3)
    counts = torch.randint(0, 3, (4, VOCAB), generator=g).float().to(device)
    prompt = (torch.rand(4, VOCAB, generator=g) < 0.1).to(torch.uint8).to(device)
    wide = _logits(rng, 5, device).repeat(1, 2)  # rows with a stride of 2 V
    logits = wide[:, :VOCAB]
    settings = torch.tensor([[2, 1.3, 0.5, 0.7], [-1, 1, 0, 0], [0, 0.8, -0.25, 0], [3, 1.0, 0.0, 1.0],
                             [1, 1.3, 0.5, 0.3]]).to(device)
    got = kernels.penalize(logits, counts, prompt, settings)
    for row in range(5):
        slot = int(settings[row, 0])
        want = logits[row] if slot < 0 else penalize_reference_row(logits[row], counts[slot], prompt[slot],
                                                                   *settings[row, 1:])
        assert torch.equal(got[row].cpu(), want.cpu()), row
    tokens = torch.tensor([7, 8, 7, 299, 0], device=device)
    expected = counts.clone()
    for row, token in enumerate(tokens.tolist()):
        if settings[row, 0] >= 0:
            expected[int(settings[row, 0]), token] += 1
    kernels.record(counts, settings, tokens)
    assert torch.equal(counts, expected)


def penalize_reference_row(logits, counts, prompt, rep, freq, presence):
    from replicas.penalties import _penalize

    return _penalize(logits, counts, prompt.bool(), rep, freq, presence)


def test_the_sampler_counts_its_own_draws():
    """Through Sampler.sample, the drawn tokens appended as the engine appends them: a frequency penalty of 2
    over logits 1 apart never draws a token twice, and the state filled each sequence once."""
    from replicas.sampler import Sampler

    sampler = Sampler(seed=0)
    seqs = [Sequence(f"s{i}", [1, 2], SamplingParams(temperature=0, frequency_penalty=2.0)) for i in range(3)]
    logits = torch.zeros(3, 12)
    logits[:, 5] = 1.0  # every row's argmax, until its penalty pushes it down
    fills = _count_fills(sampler.penalties)
    for _ in range(12):
        tokens = sampler.sample(logits, seqs).token_ids.tolist()
        for seq, token in zip(seqs, tokens):
            seq.append_token(token)
    for seq in seqs:
        assert sorted(seq.output_token_ids) == list(range(12))
    assert fills == [3]


def test_a_finished_sequences_slot_goes_before_a_live_ones():
    """A new sequence takes the slot of one that finished, not those of live sequences sitting the step out
    (which would have to be refilled from their lists when they come back)."""
    rng = random.Random(4)
    state = PenaltyState()
    seqs = [Sequence(f"s{i}", [i], SamplingParams(presence_penalty=1.0)) for i in range(8)]
    _check(state, _logits(rng, 8, "cpu"), seqs)
    seqs[3].status = SequenceStatus.FINISHED_ABORTED
    newcomer = Sequence("new", [5], SamplingParams(presence_penalty=1.0))
    _check(state, _logits(rng, 1, "cpu"), [newcomer])
    fills = _count_fills(state)
    live = seqs[:3] + seqs[4:] + [newcomer]
    _check(state, _logits(rng, 8, "cpu"), live)
    assert fills == [] and state.capacity == 8


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_through_the_engine_every_step_equals_the_reference(make_llm, async_scheduling):  # noqa: F811
    """An engine's penalized draws (seeded sampling, n = 2, preemption by a small cache, async or not) each
    checked against the host lists' reference at that step; the state fills a slot about once a sequence."""
    llm = make_llm(async_scheduling=async_scheduling, num_kv_blocks=6, block_size=16, enable_prefix_caching=False,
                   max_num_seqs=4)
    state = llm.engine.sampler.penalties
    apply, fills, checked = state.apply, _count_fills(state), []

    def checking(logits, seqs, params):
        got, draw = apply(logits, seqs, params)
        assert torch.equal(got, penalize_reference(logits, seqs, params))
        checked.append(len(draw.rows))
        return got, draw

    state.apply = checking
    params = [seeded(i, max_tokens=30, ignore_eos=True, n=2 if i % 2 else 1, repetition_penalty=1.2,
                     frequency_penalty=0.4, presence_penalty=0.3 * (i % 3)) for i in range(len(PROMPTS))]
    seqs = submit(llm.engine, PROMPTS, params, [None] * len(PROMPTS))
    final = run_steps(llm.engine)
    assert sum(s.num_preemptions for s in seqs.values()) > 0
    assert all(len(c.token_ids) == 30 for out in final.values() for c in out.outputs)
    sequences = len(PROMPTS) + sum(p.n - 1 for p in params)
    assert sum(checked) == 30 * sequences and sequences <= sum(fills) <= 2 * sequences  # 9 fills when written
