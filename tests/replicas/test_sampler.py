"""Sampler: greedy, top_k/top_p/min_p, penalties, seeded reproducibility, logprobs."""

from __future__ import annotations

import pytest
import torch

from replicas.penalties import PenaltyState, penalize_reference
from replicas.sampler import Sampler
from replicas.sampling_params import SamplingParams
from replicas.sequence import Sequence

PROBS = [0.4, 0.3, 0.15, 0.1, 0.05]


def seqs_for(params, prompt=(1, 2), outputs=()):
    out = []
    for i, p in enumerate(params):
        s = Sequence(f"r{i}", list(prompt), p)
        s.output_token_ids = list(outputs)
        out.append(s)
    return out


def sample(logits, **kw):
    params = [SamplingParams(**kw) for _ in range(logits.shape[0])]
    return Sampler().sample(logits, seqs_for(params))


def support(n=4000, **kw):
    logits = torch.tensor(PROBS).log().expand(n, -1).contiguous()
    return torch.bincount(sample(logits, **kw).token_ids, minlength=len(PROBS))


def test_greedy_is_argmax():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    tokens, lps = sample(logits, temperature=0)
    assert torch.equal(tokens, logits.argmax(-1)) and lps == [None] * 8


@pytest.mark.parametrize("kw", [dict(top_k=1), dict(top_p=1e-6), dict(temperature=1e-4), dict(min_p=1.0)])
def test_filters_that_reduce_to_greedy(kw):
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(1))
    kw = {"temperature": 1.0, **kw}
    assert torch.equal(sample(logits, **kw).token_ids, logits.argmax(-1))


def test_plain_sampling_follows_the_distribution():
    freq = support(n=20000).float() / 20000
    assert torch.allclose(freq, torch.tensor(PROBS), atol=0.02)


@pytest.mark.parametrize(
    "kw, allowed",
    [
        (dict(top_k=2), {0, 1}),
        (dict(top_p=0.6), {0, 1}),  # 0.4 < 0.6, 0.4 + 0.3 covers it
        (dict(top_p=0.75), {0, 1, 2}),
        (dict(min_p=0.5), {0, 1}),  # keep p >= 0.5 * 0.4
        (dict(min_p=0.3), {0, 1, 2}),
        (dict(top_k=3, top_p=0.5), {0, 1}),
    ],
)
def test_filters_restrict_support(kw, allowed):
    counts = support(**kw)
    assert {i for i, c in enumerate(counts.tolist()) if c} == allowed


def test_mixed_batch_keeps_each_rows_settings():
    logits = torch.tensor(PROBS).log().expand(6, -1).contiguous()
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1), SamplingParams(seed=3),
              SamplingParams(temperature=0, presence_penalty=2.0), SamplingParams(), SamplingParams(top_p=1e-9)]
    seqs = seqs_for(params, outputs=[0])
    tokens, _ = Sampler().sample(logits, seqs)
    assert tokens[[0, 1, 5]].tolist() == [0, 0, 0] and tokens[3].item() == 1  # penalty moves row 3 off token 0


def test_penalties_match_their_definitions():
    vocab = 8
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5, -0.5, 3.0, 0.0, 1.5]] * 4)
    params = [
        SamplingParams(temperature=0, presence_penalty=1.5),
        SamplingParams(temperature=0, frequency_penalty=0.5),
        SamplingParams(temperature=0, repetition_penalty=2.0),
        SamplingParams(temperature=0),
    ]
    seqs = seqs_for(params, prompt=(0, 1), outputs=(3, 3, 5))
    exp = logits.clone()
    exp[0, [3, 5]] -= 1.5  # presence: once per distinct output token
    exp[1, 3] -= 1.0  # frequency: per occurrence
    exp[1, 5] -= 0.5
    for t in (0, 3, 5):  # repetition: prompt and output tokens; positive logits divided
        exp[2, t] /= 2.0
    exp[2, 1] *= 2.0  # negative logits multiplied
    got = penalize_reference(logits, seqs, params)
    assert torch.allclose(got, exp) and got.shape == (4, vocab)
    assert torch.equal(PenaltyState().apply(logits, seqs, params)[0], got)


def test_penalties_change_sampling_not_logprobs():
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    seq = seqs_for([SamplingParams(temperature=0, frequency_penalty=1.0, logprobs=1)], outputs=[0])
    tokens, lps = Sampler().sample(logits, seq)
    assert tokens.item() == 1
    assert lps[0].logprob == pytest.approx(logits.log_softmax(-1)[0, 1].item())


def test_sampling_leaves_the_logits_alone():
    """The sampler reads the logits without copying them first (a decode step's are the CUDA graph's static
    buffer): penalties, temperature, top-k/top-p, min-p and logprobs must all leave them as they were."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    before = logits.clone()
    for repetition in (1.0, 1.3):  # with a repetition penalty, and without (then the others act on the logits)
        params = [SamplingParams(temperature=0, repetition_penalty=repetition, presence_penalty=0.5, logprobs=2),
                  SamplingParams(temperature=0.7, top_k=5, top_p=0.8, min_p=0.05, seed=1, frequency_penalty=0.4),
                  SamplingParams(temperature=1.2, logprobs=1)]
        Sampler().sample(logits, seqs_for(params, outputs=[4, 4, 7]))
        assert torch.equal(logits, before)


def run_seeded(seed, batch_position, batch_size, steps=6, vocab=40):
    """Tokens of one seeded request sampled inside a batch of unseeded/other requests."""
    target = Sequence("t", [1], SamplingParams(seed=seed, top_p=0.95))
    others = [Sequence(f"o{i}", [1], SamplingParams(seed=None if i % 2 else 100 + i)) for i in range(batch_size - 1)]
    batch = others[:batch_position] + [target] + others[batch_position:]
    g = torch.Generator().manual_seed(1234)
    logits_target = [torch.randn(vocab, generator=g) for _ in range(steps)]
    sampler, tokens = Sampler(), []
    for step in range(steps):
        logits = torch.randn(len(batch), vocab)
        logits[batch_position] = logits_target[step]
        tokens.append(sampler.sample(logits, batch).token_ids[batch_position].item())
    return tokens


def test_seeded_sampling_reproducible_regardless_of_batch():
    alone = run_seeded(7, 0, 1)
    assert run_seeded(7, 0, 1) == alone
    assert run_seeded(7, 2, 5) == alone
    assert run_seeded(7, 4, 8) == alone
    assert run_seeded(8, 0, 1) != alone


def test_logprobs_match_log_softmax():
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(5)) * 3
    params = [SamplingParams(logprobs=5, seed=1), SamplingParams(logprobs=0, temperature=0), SamplingParams()]
    tokens, lps = Sampler().sample(logits, seqs_for(params))
    ref = logits.log_softmax(-1)
    top_lp, top_ids = ref[0].topk(5)
    assert lps[0].top_token_ids == top_ids.tolist()
    assert lps[0].top_logprobs == pytest.approx(top_lp.tolist(), abs=1e-6)
    for row in (0, 1):
        t = tokens[row].item()
        assert lps[row].token_id == t and lps[row].logprob == pytest.approx(ref[row, t].item(), abs=1e-6)
        assert lps[row].rank == int((ref[row] > ref[row, t]).sum()) + 1
    assert lps[1].rank == 1 and lps[1].top_token_ids == [] and lps[1].as_dict() == {tokens[1].item(): lps[1].logprob}
    assert lps[2] is None


def test_row_count_mismatch_is_an_error():
    with pytest.raises(ValueError, match="2 logits rows for 1 sequences"):
        Sampler().sample(torch.zeros(2, 4), seqs_for([SamplingParams()]))


ON_DEVICES = pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])


@ON_DEVICES
def test_min_tokens_masks_eos_and_stop_ids_until_reached(device):
    """Short of min_tokens, EOS (unless ignore_eos) and the stop token ids cannot be sampled; from then on they can;
    logprobs stay the model's."""
    logits = torch.zeros(4, 8, device=device)
    logits[:, 2] = 5.0  # EOS, the greedy pick
    logits[:, 6] = 4.0  # a stop token id, second
    params = [SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[6, 99], logprobs=1),  # 99: past the vocab
              SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[6], ignore_eos=True),
              SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[6]),
              SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[6], seed=0)]
    seqs = seqs_for(params, outputs=[1, 1])  # two tokens generated so far
    for s in seqs:
        s.eos_token_ids = frozenset({2})
    out = Sampler().sample(logits, seqs)
    assert out.token_ids.tolist()[:3] == [0, 2, 2] and out.token_ids[3] not in (2, 6)
    assert out.logprobs[0].top_token_ids == [2]  # the raw distribution, EOS first
    assert logits[0, 2] == 5.0  # the input is left alone


@ON_DEVICES
def test_logit_bias_forces_and_bans_tokens(device):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)).to(device)
    top = logits.argmax(-1)
    params = [SamplingParams(temperature=0, logit_bias={int(top[0]): -100}),
              SamplingParams(temperature=1.0, logit_bias={7: 100}, seed=3),
              SamplingParams(temperature=0)]
    out = Sampler().sample(logits, seqs_for(params)).token_ids
    assert out[0] == logits[0].topk(2).indices[1] and out[1] == 7 and out[2] == top[2]


@ON_DEVICES
def test_allowed_token_ids_restrict_each_rows_choice(device):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2)).to(device)
    allowed = [3, 9, 41]
    params = [SamplingParams(temperature=0, allowed_token_ids=allowed),
              SamplingParams(temperature=1.0, seed=5, allowed_token_ids=[7]),
              SamplingParams(temperature=0)]
    out = Sampler().sample(logits, seqs_for(params)).token_ids.tolist()
    assert out[0] == allowed[int(logits[0, allowed].argmax())] and out[1] == 7
    assert out[2] == int(logits[2].argmax())


@pytest.mark.gpu
def test_sampling_never_waits_for_the_gpu():
    """Under async scheduling the sampler's kernels queue behind a step still running: no call may synchronize
    (CUDA's sync debug mode makes one an error). Every setting that moves host values to the device is on; the
    logprobs are read back after, on first use."""
    from replicas.grammar import apply_token_masks  # noqa: F401  (the masks' path: test_structured_outputs.py)

    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(5)).cuda()
    params = [SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, seed=1, logprobs=2),
              SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.2, repetition_penalty=1.1),
              SamplingParams(temperature=0, logit_bias={3: 5.0}, min_tokens=4, stop_token_ids=[7]),
              SamplingParams(temperature=1.0, allowed_token_ids=[5, 9, 11]),
              SamplingParams(temperature=0, logprobs=0),
              SamplingParams(temperature=1.0)]
    seqs = seqs_for(params, outputs=[4, 5, 4])
    masks = torch.full((6, 10), -1, dtype=torch.int32).pin_memory()
    masks[5] = 0
    masks[5, 0] = 1 << 8  # row 5: token 8 only
    nucleus = [SamplingParams(temperature=0.8, top_p=0.9, seed=3), SamplingParams(temperature=0.8, top_p=0.5)]
    wide = torch.randn(2, 128_256, device="cuda")  # top_p without top_k: the vocabulary's sort, at full width
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = Sampler().sample(logits, seqs, token_masks=masks)
        Sampler().sample(wide, seqs_for(nucleus))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ids = out.token_ids.tolist()
    assert ids[3] in (5, 9, 11) and ids[5] == 8
    assert out.logprobs[0].token_id == ids[0] and len(out.logprobs[0].top_token_ids) == 2
    assert out.logprobs[1] is None and out.logprobs[4].rank == 1


@ON_DEVICES
def test_bad_words_ban_a_words_last_token_after_the_rest_of_it(device):
    logits = torch.zeros(3, 20, device=device)
    logits[:, 8] = 3.0  # every row's greedy pick ...
    logits[:, 6] = 2.0  # ... then this one
    seqs = seqs_for([SamplingParams(temperature=0)] * 3)
    words = ((8,), (4, 6), (1, 2, 6))
    for s, out in zip(seqs, ([], [5, 2], [9, 1, 2])):
        s.output_token_ids = out
        s.bad_words_ids = words
    ids = Sampler().sample(logits, seqs).token_ids.tolist()
    # 8 is banned everywhere (a one-token word); 6 only where the output ends with 1, 2 (row 2); row 1 ends
    # with 2 alone, row 0 with nothing, so there 6 stays
    assert ids[0] == 6 and ids[1] == 6 and ids[2] not in (8, 6)


@ON_DEVICES
def test_top_k_candidates_draw_from_the_same_distribution_as_the_vocabulary(device, monkeypatch):
    """Rows with a small top_k draw among torch.topk's candidates, the others over the sorted vocabulary: with
    min_p and top_p on top, both follow the same distribution (the masked, renormalised softmax)."""
    from replicas import sampler as sampler_module

    gen = torch.Generator().manual_seed(11)
    row = torch.randn(40, generator=gen) * 2
    n = 6000
    logits = row.expand(n, -1).contiguous().to(device)
    settings = dict(temperature=0.9, top_k=6, top_p=0.85, min_p=0.04)
    # the reference: the filters by their definitions, on the row alone
    scaled = row / 0.9
    probs = scaled.softmax(-1)
    order = probs.argsort(descending=True)
    keep = torch.zeros(40, dtype=torch.bool)
    keep[order[:6]] = True
    keep &= probs >= 0.04 * probs.max()
    kept = torch.where(keep, probs, torch.zeros(())) / torch.where(keep, probs, torch.zeros(())).sum()
    before = kept[order].cumsum(0) - kept[order]
    final = torch.zeros(40)
    final[order] = torch.where(before < 0.85, kept[order], torch.zeros(()))
    final /= final.sum()
    for candidates in (1024, 0):  # 0: every row takes the sorted-vocabulary path
        monkeypatch.setattr(sampler_module, "TOP_K_CANDIDATES", candidates)
        params = [SamplingParams(seed=i, **settings) for i in range(n)]
        tokens = Sampler().sample(logits, seqs_for(params)).token_ids.cpu()
        freq = torch.bincount(tokens, minlength=40).float() / n
        assert torch.allclose(freq, final, atol=0.02), (candidates, freq, final)
        assert set(tokens.tolist()) == set(final.nonzero().flatten().tolist())


def test_a_seeded_top_k_row_draws_the_same_beside_any_rows():
    """A seeded row's draws use noise over its own top_k columns only: neighbours with a larger top_k, or none
    (the vocabulary path), change nothing."""
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(4))
    me = SamplingParams(seed=5, temperature=1.5, top_k=20)
    draws = []
    for neighbour in (None, SamplingParams(seed=1, top_k=200), SamplingParams(seed=1), SamplingParams(seed=1, top_k=3)):
        params = [me] if neighbour is None else [neighbour, me]
        rows = logits[:1] if neighbour is None else logits[:2].flip(0)  # `me` always on the same logits row
        seqs = seqs_for(params)
        picks = [Sampler().sample(rows, seqs).token_ids[-1].item() for _ in range(12)]
        draws.append(picks)
    assert all(d == draws[0] for d in draws) and len(set(draws[0])) > 1
