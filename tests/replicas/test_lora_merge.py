"""Merged LoRA (EngineArgs.lora_merge_steps): steps whose rows all use one adapter run it merged into the base
weights; outputs equal the LoRA path's, and the base weights come back exactly."""

from __future__ import annotations

import pytest
import torch

from lora_core.config import LoRAConfig
from lora_core.errors import LoRAConfigError
from lora_core.request import LoRARequest
from replicas import lora_merge
from replicas.engine_args import EngineArgs
from replicas.llm import LLM
from replicas.sampling_params import SamplingParams
from tests.replicas.engine_cases import PROMPTS

STEPS = 10


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=STEPS, logprobs=1, ignore_eos=True)


def _llm(demo, **kwargs) -> LLM:
    # float32; on a GPU (the device) with CUDA graphs: merged steps replay the base graphs
    kwargs = dict(enable_lora=True, max_loras=2, max_lora_rank=32, dtype="float32", num_kv_blocks=128) | kwargs
    return LLM(str(demo.model_dir), **kwargs)


def _runs(outputs) -> list[tuple[list[int], list[float]]]:
    runs = []
    for out in outputs:
        assert out.error is None, out.error
        c = out.outputs[0]
        runs.append((c.token_ids, [step[t] for step, t in zip(c.logprobs, c.token_ids)]))
    return runs


def _assert_same(got, want, tol: float) -> None:
    for (g_tokens, g_lps), (w_tokens, w_lps) in zip(got, want, strict=True):
        assert g_tokens == w_tokens
        assert max(abs(a - b) for a, b in zip(g_lps, w_lps, strict=True)) <= tol


def _state(llm: LLM):
    return llm.engine.executor.call("lora_merge_state")


def _weights(llm: LLM) -> list[torch.Tensor]:
    return [w.detach().clone() for w, _ in llm.engine.executor.runner.merger._layers]


def _weights_are_base(llm: LLM) -> bool:
    return all(torch.equal(w.view(torch.int32), base.view(torch.int32))
               for w, base in zip(_weights(llm), llm.base_weights))


@pytest.fixture(scope="module")
def reference(demo):
    return _llm(demo)


def _merging_llm(demo, **kwargs) -> LLM:
    """An engine that merges after two steps, whatever the share of base values the demo's large adapters
    need kept (up to a third of the elements: the undo may take a copy's bytes here) and however short its
    merges last (no wait grows), and its weights as loaded, to compare with after each unmerge."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lora_merge, "MAX_UNDO_SHARE", 1.0)
        llm = _llm(demo, lora_merge_steps=2, **kwargs)
    llm.engine.executor.runner.merger.payback_steps = 0
    llm.base_weights = _weights(llm)
    return llm


@pytest.fixture(scope="module")
def merging(demo):
    return _merging_llm(demo)


def test_one_adapter_runs_merged_and_matches_the_lora_path(demo, loras, reference, merging):
    """Each adapter alone (rsLoRA attention+MLP, rank 32, MLP only): merged after two steps, greedy tokens
    equal and logprobs within float32 rounding; switching adapters unmerges the last one first."""
    merges = _state(merging)[1]
    for name in ("demo-chat", "demo-translate", "demo-summarize"):
        lora = loras[name]
        want = _runs(reference.generate(PROMPTS[:3], _params(), [lora] * 3))
        got = _runs(merging.generate(PROMPTS[:3], _params(), [lora] * 3))
        _assert_same(got, want, 1e-4)
        merged, count = _state(merging)
        assert merged == lora.lora_int_id and count == merges + 1
        merges = count


def test_a_step_with_other_rows_unmerges_and_the_base_weights_are_exact(loras, reference, merging):
    """Base requests after a merged adapter: identical logprobs to an engine that never merged (the weights
    are restored bit for bit, without a copy of them). A mixed batch never merges."""
    lora = loras["demo-sql"]
    merging.generate(PROMPTS[:2], _params(), [lora] * 2)
    assert _state(merging)[0] == lora.lora_int_id and not _weights_are_base(merging)
    want = _runs(reference.generate(PROMPTS[:3], _params(), None))
    got = _runs(merging.generate(PROMPTS[:3], _params(), None))
    assert got == want
    assert _state(merging)[0] is None and _weights_are_base(merging)
    merges = _state(merging)[1]
    mixed = [lora, None, loras["demo-chat"], lora]
    _assert_same(_runs(merging.generate(PROMPTS[:4], _params(), mixed)),
                 _runs(reference.generate(PROMPTS[:4], _params(), mixed)), 1e-4)
    assert _state(merging) == (None, merges)


def test_removed_adapter_is_unmerged_and_its_id_can_come_back(demo, loras, tmp_path, merging):
    chat = loras["demo-chat"]
    merging.generate(PROMPTS[:2], _params(), [chat] * 2)
    assert _state(merging)[0] == chat.lora_int_id
    merging.engine.remove_lora(chat.lora_name)
    assert _state(merging)[0] is None and _weights_are_base(merging)
    # the same id and name now name another adapter's weights
    other = LoRARequest(chat.lora_name, chat.lora_int_id, str(demo.adapters["demo-translate"]))
    translate = _llm(demo).generate(PROMPTS[:2], _params(), [loras["demo-translate"]] * 2)
    _assert_same(_runs(merging.generate(PROMPTS[:2], _params(), [other] * 2)), _runs(translate), 1e-4)
    merging.engine.remove_lora(chat.lora_name)
    merging.engine.add_lora(chat)


def test_an_adapter_whose_undo_would_keep_too_many_values_stays_on_the_lora_path(demo, loras, reference):
    """A merge that would keep more base values than max_fixups writes no weight (they stay exactly as
    loaded) and that adapter is served on the LoRA path from then on; so is one that another TP rank could
    not merge."""
    llm = _merging_llm(demo)
    merger = llm.engine.executor.runner.merger
    lora, other = loras["demo-sql"], loras["demo-chat"]
    llm.generate(PROMPTS[:2], _params(), [lora] * 2)
    assert _state(llm)[0] == lora.lora_int_id and merger.fixups() > 0
    elements = sum(w.numel() for w in llm.base_weights)
    assert merger.fixups() < 0.11 * elements  # the demo's sql adapter: 1 in 10 elements' base values kept
    assert merger.backup_bytes() > merger.fixups() * 8  # those (index and value) and the adapter's factors
    merger.max_fixups = merger.fixups() - 1  # the next merge of it needs one more than it may keep
    llm.generate(PROMPTS[:1], _params(), None)  # unmerges
    want = _runs(reference.generate(PROMPTS[:3], _params(), [lora] * 3))
    _assert_same(_runs(llm.generate(PROMPTS[:3], _params(), [lora] * 3)), want, 1e-4)
    assert _state(llm) == (None, 1) and _weights_are_base(llm) and merger.backup_bytes() == 0
    assert not merger.mergeable(lora.lora_int_id)
    merger.max_fixups = 10**12
    merger._agree = lambda ok: False  # another TP rank's merge did not fit: none merges
    _assert_same(_runs(llm.generate(PROMPTS[:3], _params(), [other] * 3)),
                 _runs(reference.generate(PROMPTS[:3], _params(), [other] * 3)), 1e-4)
    assert _state(llm) == (None, 1) and _weights_are_base(llm) and not merger.mergeable(other.lora_int_id)


def test_adapter_with_embedding_or_lm_head_weights_stays_on_the_lora_path(demo, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(demo.model_dir, dtype=torch.float32).eval()
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["lm_head", "q_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.2)
    model.save_pretrained(tmp_path / "head")
    lora = LoRARequest("head", 9, str(tmp_path / "head"))
    llm, ref = _llm(demo, lora_merge_steps=1), _llm(demo)
    _assert_same(_runs(llm.generate(PROMPTS[:2], _params(), [lora] * 2)),
                 _runs(ref.generate(PROMPTS[:2], _params(), [lora] * 2)), 1e-5)
    assert _state(llm) == (None, 0)


def test_tensor_parallel_ranks_merge_their_own_shards(demo, loras):
    """TP=2 (gloo, two CPU processes): every rank merges its shards from its slots; outputs equal TP=1."""
    lora = loras["demo-sql"]  # 1 in 10 elements' base values kept on each rank: within MAX_UNDO_SHARE in float32
    ref = _llm(demo, device="cpu")
    want = _runs(ref.generate(PROMPTS[:3], _params(), [lora] * 3))
    llm = _llm(demo, tensor_parallel_size=2, lora_merge_steps=2, device="cpu")
    try:
        _assert_same(_runs(llm.generate(PROMPTS[:3], _params(), [lora] * 3)), want, 1e-4)
        assert _state(llm)[0] == lora.lora_int_id
        _assert_same(_runs(llm.generate(PROMPTS[:3], _params(), None)),
                     _runs(ref.generate(PROMPTS[:3], _params(), None)), 1e-4)
        assert _state(llm)[0] is None
    finally:
        llm.shutdown()


def test_settings_that_need_whole_a_rows_on_every_rank_are_refused(demo):
    with pytest.raises(ValueError, match="lora_merge_steps"):
        EngineArgs(model="m", lora_merge_steps=-1)
    with pytest.raises(ValueError, match="enable_lora"):
        EngineArgs(model="m", lora_merge_steps=4)
    with pytest.raises(LoRAConfigError, match="fully-sharded"):
        _llm(demo, tensor_parallel_size=2, fully_sharded_loras=True, lora_merge_steps=4, device="cpu")
    # stacked A rows (lora_core/stacked_a.py) need whole A rows on every rank too
    with pytest.raises(ValueError, match="lora_stacked_max_tokens"):
        EngineArgs(model="m", lora_stacked_max_tokens=-1)
    with pytest.raises(LoRAConfigError, match="lora_stacked_max_tokens needs whole A rows"):
        _llm(demo, tensor_parallel_size=2, fully_sharded_loras=True, lora_stacked_max_tokens=16, device="cpu")
    # the refused engine's workers and process group are gone: the next TP engine in this process starts
    llm = _llm(demo, tensor_parallel_size=2, device="cpu")
    try:
        assert _runs(llm.generate(PROMPTS[:1], _params(), None))[0][0]
    finally:
        llm.shutdown()


def test_merges_that_do_not_pay_for_themselves_make_the_next_one_wait_longer(demo, loras, reference):
    """A merge undone within payback_steps doubles the streak the next one waits for (traffic that keeps
    breaking one adapter's runs soon stops paying for merges); one that lasted resets it to merge_after."""
    llm = _merging_llm(demo)
    merger = llm.engine.executor.runner.merger
    merger.payback_steps = 30
    lora = loras["demo-sql"]

    def run(steps: int) -> None:  # one request of the adapter alone (a prompt step, then decode steps), then base
        params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
        llm.generate(PROMPTS[:1], params, [lora])
        llm.generate(PROMPTS[:1], _params(), None)

    waits, merges = [], []
    for _ in range(4):
        run(10)
        waits.append(merger.wait)
        merges.append(_state(llm)[1])
    assert waits == [4, 8, 16, 16] and merges == [1, 2, 3, 3]  # the 4th run's 10 steps never reached 16
    run(50)  # merged after 16 steps, for 34: paid
    assert merger.wait == 2 and _state(llm)[1] == 4 and _weights_are_base(llm)
    merger.wait = 2 << lora_merge.MAX_WAIT_DOUBLINGS
    run(170)  # merged after 128 steps, for 42: paid
    assert merger.wait == 2 and _state(llm)[1] == 5
    merger.payback_steps = 10**6
    merger.wait = 2 << lora_merge.MAX_WAIT_DOUBLINGS
    run(140)  # merged after 128 steps, for 12: not paid, and the wait stays at its cap
    assert merger.wait == 2 << lora_merge.MAX_WAIT_DOUBLINGS and _state(llm)[1] == 6
    want = _runs(reference.generate(PROMPTS[:2], _params(), [lora] * 2))
    _assert_same(_runs(llm.generate(PROMPTS[:2], _params(), [lora] * 2)), want, 1e-4)


def test_merging_is_on_by_default_where_adapters_can_merge():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    plain = LoRAConfig(max_loras=2, max_lora_rank=16)
    assert lora_merge.merge_after_steps(None, plain, cuda, 1) == lora_merge.DEFAULT_MERGE_AFTER
    assert lora_merge.merge_after_steps(None, plain, cpu, 1) == 0
    sharded = LoRAConfig(max_loras=2, max_lora_rank=16, fully_sharded_loras=True)
    assert lora_merge.merge_after_steps(None, sharded, cuda, 2) == 0
    assert lora_merge.merge_after_steps(None, sharded, cuda, 1) == lora_merge.DEFAULT_MERGE_AFTER
    assert lora_merge.merge_after_steps(None, LoRAConfig(max_loras=2, max_lora_rank=16, bias_enabled=True),
                                        cuda, 1) == 0
    assert lora_merge.merge_after_steps(3, plain, cpu, 1) == 3
    assert lora_merge.merge_after_steps(0, plain, cuda, 1) == 0
