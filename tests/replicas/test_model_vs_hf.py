"""Our model (TP=1, float32) against HF transformers on the same tiny random checkpoints.

Every architecture variant runs twice: all prompts prefilled in one batch, and
an engine-like run through the paged cache where steps mix prefill chunks,
fresh prefills and decode tokens of sequences of different lengths.
"""

from __future__ import annotations

import pytest
import torch

from tests.replicas.conftest import CHECKPOINTS, MIXED_STEPS, build_model, run_steps, sequence_tokens

ATOL = 1e-4


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def case(request, tiny_checkpoint):
    """(our model, {seq: tokens}, {seq: HF logits [len, V]}) for one checkpoint."""
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint(request.param)
    model = build_model(path)
    tokens = sequence_tokens(MIXED_STEPS, model.config.vocab_size)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        expected = {seq: hf(torch.tensor([ids])).logits[0] for seq, ids in tokens.items()}
    return model, tokens, expected


def _assert_close(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    for seq, want in expected.items():
        assert got[seq].shape == want.shape, seq
        torch.testing.assert_close(got[seq], want, atol=ATOL, rtol=0, msg=lambda m: f"sequence {seq}: {m}")


def test_prefill_batch_matches_hf(case):
    model, tokens, expected = case
    _assert_close(run_steps(model, [[(seq, len(ids)) for seq, ids in tokens.items()]], tokens), expected)


def test_mixed_prefill_and_decode_steps_match_hf(case):
    model, tokens, expected = case
    _assert_close(run_steps(model, MIXED_STEPS, tokens), expected)


def test_logits_are_not_trivial(case):
    """The checkpoints' weights make logits spread out, so a 1e-4 match means something."""
    _, _, expected = case
    assert min(float(logits.std()) for logits in expected.values()) > 0.1


def test_tied_head_shares_the_embedding(tiny_checkpoint):
    model = build_model(tiny_checkpoint("llama3_tied"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    untied = build_model(tiny_checkpoint("qwen2"))
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
