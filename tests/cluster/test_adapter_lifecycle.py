"""A load or re-point completes or changes nothing: the adapter tier (no Ray) and the in-process API.

The broken adapters are real PEFT ones, written by peft over transformers models: one of rank 64 on the
demo model's shapes (over the deployment's max_lora_rank), and one of another model (hidden size 64 where
the demo's is 128). Each must be refused before it counts as registered, with an error that names the
lora_path the caller sent, and a name it would re-point must keep serving its old weights.
"""

from __future__ import annotations

import asyncio
import copy
import json
import shutil
import tempfile
import warnings
from pathlib import Path

import openai
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from cluster.adapter_registry import REGISTRY_FILE
from cluster.adapter_tier import AdapterTier
from lora_core.config import LoRAConfig
from lora_core.errors import InvalidAdapterError
from replicas.demo_checkpoint import ensure_demo_checkpoint
from replicas.lora_setup import served_adapter_fit
from tests.cluster.api_cases import ENGINE, open_stack, run
from tests.cluster.test_adapter_tier import CountingParse


def _peft_adapter(out: Path, model_config: dict, r: int) -> Path:
    """A PEFT adapter of rank r on q_proj / v_proj of a Llama built from model_config, saved by peft."""
    torch.manual_seed(r)
    base = LlamaForCausalLM(LlamaConfig(**model_config)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(base, LoraConfig(r=r, lora_alpha=r, target_modules=["q_proj", "v_proj"]))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:  # peft starts B at zero: make the adapter change something
                    param.normal_(0, 0.05)
        model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    """good: the demo's demo-sql; wide: rank 64 on the demo's shapes; foreign: rank 8 on a hidden-64 Llama."""
    root = tmp_path_factory.mktemp("lifecycle-adapters")
    demo = ensure_demo_checkpoint()
    shapes = json.loads((demo.model_dir / "config.json").read_text())
    shapes = {k: shapes[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                     "num_key_value_heads", "head_dim", "vocab_size")}
    foreign = dict(shapes, hidden_size=64, intermediate_size=96, num_attention_heads=2, num_key_value_heads=1)
    return {"good": Path(shutil.copytree(demo.adapters["demo-sql"], root / "good")),
            "wide": _peft_adapter(root / "wide", shapes, r=64),
            "foreign": _peft_adapter(root / "foreign", foreign, r=8)}


@pytest.fixture(scope="module")
def fit():
    """What the in-process stack's engines take (ENGINE: max_lora_rank 32) on the demo model."""
    return served_adapter_fit(str(ensure_demo_checkpoint().model_dir), LoRAConfig(
        max_loras=ENGINE["max_loras"], max_lora_rank=ENGINE["max_lora_rank"]))


def _no_server_paths(message: str, sent: Path | None = None) -> None:
    """No path of the server's own in message, where the lora_path the caller sent (under /tmp in tests) may be."""
    rest = message.replace(str(sent), "<sent>") if sent is not None else message
    assert tempfile.gettempdir() not in rest and "lorafleet-adapter" not in rest, message


# ---- the tier ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("broken,needle", [("wide", "max_lora_rank"), ("foreign", "in_features")])
def test_a_refused_repoint_keeps_the_old_weights_and_the_registry_file(adapters, fit, tmp_path, broken, needle):
    parse = CountingParse(adapters["good"].parent)
    tier = AdapterTier(parse, capacity_bytes=1 << 30, registry_dir=tmp_path)
    before = asyncio.run(tier.load("prod", str(adapters["good"]), fit))
    saved = (tmp_path / REGISTRY_FILE).read_bytes()
    with pytest.raises(InvalidAdapterError, match=needle) as info:
        asyncio.run(tier.load("prod", str(adapters[broken]), fit))
    assert str(adapters[broken]) in str(info.value)  # the lora_path sent, not the tier's fetch directory
    _no_server_paths(str(info.value), adapters[broken])
    assert tier.registered() == {"prod": str(adapters["good"])}
    assert (tmp_path / REGISTRY_FILE).read_bytes() == saved
    fetches = len(parse.fetched)
    assert asyncio.run(tier.get("prod")) is before and len(parse.fetched) == fetches  # still cached, same blob


@pytest.mark.parametrize("broken", ["wide", "foreign"])
def test_an_adapter_the_model_cannot_serve_never_registers(adapters, fit, tmp_path, broken):
    tier = AdapterTier(CountingParse(adapters["good"].parent), capacity_bytes=1 << 30, registry_dir=tmp_path)
    with pytest.raises(InvalidAdapterError):
        asyncio.run(tier.load("new", str(adapters[broken]), fit))
    assert tier.registered() == {} and tier.cached() == [] and not (tmp_path / REGISTRY_FILE).exists()


def test_without_a_fit_only_the_format_is_checked(adapters):
    """The tier alone knows no model: the foreign adapter is well-formed PEFT; the fit is what refuses it."""
    tier = AdapterTier(CountingParse(adapters["good"].parent), capacity_bytes=1 << 30)
    asyncio.run(tier.load("x", str(adapters["foreign"])))
    assert tier.registered() == {"x": str(adapters["foreign"])}


def test_a_repoint_serves_the_old_weights_until_the_new_ones_are_checked(adapters, fit):
    """While the new adapter is fetched (slowly), every get answers the old blob, and once it is checked only the
    new one: never a 404 between them."""
    parse = CountingParse(adapters["good"].parent)
    tier = AdapterTier(parse, capacity_bytes=1 << 30)
    shutil.copytree(adapters["good"], adapters["good"].parent / "good-2", dirs_exist_ok=True)
    new_uri = str(adapters["good"].parent / "good-2")

    async def go():
        old = await tier.load("prod", str(adapters["good"]), fit)
        parse.delay_s = 0.5
        repoint = asyncio.ensure_future(tier.load("prod", new_uri, fit))
        seen = []
        while not repoint.done():
            seen.append(await tier.get("prod"))
            await asyncio.sleep(0.05)
        new = await repoint
        return old, seen, new, await tier.get("prod")

    old, seen, new, after = asyncio.run(go())
    switched = next((i for i, blob in enumerate(seen) if blob is not old), len(seen))
    assert switched >= 3 and all(blob is new for blob in seen[switched:]), switched  # old, then only new
    assert new is not old and after is new and tier.registered() == {"prod": new_uri}


def test_reloading_the_same_source_is_a_hit(adapters, fit):
    parse = CountingParse(adapters["good"].parent)
    tier = AdapterTier(parse, capacity_bytes=1 << 30)
    first = asyncio.run(tier.load("prod", str(adapters["good"]), fit))
    assert asyncio.run(tier.load("prod", str(adapters["good"]), fit)) is first and len(parse.fetched) == 1


# ---- the HTTP API over LoRAServer + LocalCatalog -------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tmp_path_factory, adapters):
    yield from open_stack(tmp_path_factory, adapters_root=adapters["good"].parent)


def _load(c, name: str, path: Path):
    return c._client.post("http://127.0.0.1/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})


@pytest.mark.parametrize("broken,needle", [("wide", "max_lora_rank"), ("foreign", "in_features")])
def test_the_issue_repro_a_failed_repoint_leaves_prod_serving(stack, adapters, broken, needle):
    async def go(c):
        assert (await _load(c, "prod", adapters["good"])).status_code == 200
        want = await c.completions.create(model="prod", prompt="SELECT", max_tokens=4, temperature=0)
        refused = await _load(c, "prod", adapters[broken])
        got = await c.completions.create(model="prod", prompt="SELECT", max_tokens=4, temperature=0)
        cards = {m.id: m for m in (await c.models.list()).data}
        return want, refused, got, cards

    want, refused, got, cards = run(stack, go)
    assert refused.status_code == 400 and needle in refused.text, refused.text
    assert str(adapters[broken]) in refused.json()["error"]["message"]
    _no_server_paths(refused.text, adapters[broken])
    assert got.choices[0].text == want.choices[0].text
    assert cards["prod"].root == str(adapters["good"])


def test_a_foreign_adapter_is_refused_and_never_listed(stack, adapters, monkeypatch):
    engine, added = stack[2].engine, []
    add_lora = engine.add_lora

    async def counted(request):
        added.append(request.lora_name)
        return await add_lora(request)

    monkeypatch.setattr(engine, "add_lora", counted)

    async def go(c):
        refused = await _load(c, "foreign", adapters["foreign"])
        with pytest.raises(openai.NotFoundError):
            await c.completions.create(model="foreign", prompt="hi", max_tokens=2)
        return refused, [m.id for m in (await c.models.list()).data]

    refused, models = run(stack, go)
    assert refused.status_code == 400 and "foreign" not in models, refused.text
    assert "in_features" in refused.text  # names the layer dimension it does not fit
    assert "foreign" not in stack[2].catalog._uris
    assert added == []  # refused by the catalog's check, before any engine saw it
    _no_server_paths(refused.text, adapters["foreign"])


def test_a_path_outside_the_roots_does_not_list_the_roots(stack):
    async def go(c):
        return await _load(c, "x", Path("/etc"))

    refused = run(stack, go)
    assert refused.status_code == 400 and "allowed" in refused.text
    assert str(stack[3]) not in refused.text, refused.text  # the server's roots are the operator's business


def test_an_unloaded_adapter_serves_no_later_request(stack, adapters):
    """Unload while a stream on the adapter runs: the unload answers 200 at once, a request sent after it is a
    404, the running stream still finishes whole, and the engine lets go of the adapter once it has."""
    shutil.copytree(adapters["good"], adapters["good"].parent / "short-lived", dirs_exist_ok=True)
    server = stack[2]

    async def go(c):
        assert (await _load(c, "short-lived", adapters["good"].parent / "short-lived")).status_code == 200
        stream = await c.completions.create(model="short-lived", prompt="SELECT", max_tokens=48, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
        chunks = [await stream.__anext__()]  # under way
        unloaded = await c._client.post("http://127.0.0.1/v1/unload_lora_adapter", json={"lora_name": "short-lived"})
        with pytest.raises(openai.NotFoundError):
            await c.completions.create(model="short-lived", prompt="SELECT", max_tokens=2)
        chunks += [chunk async for chunk in stream]
        with pytest.raises(openai.NotFoundError):  # after the stream: the engine drops it on this request
            await c.completions.create(model="short-lived", prompt="SELECT", max_tokens=2)
        return unloaded, chunks, [m.id for m in (await c.models.list()).data], await server.engine.list_loras()

    unloaded, chunks, models, engine_loras = run(stack, go)
    assert unloaded.status_code == 200, unloaded.text
    assert sum(len(ch.choices[0].text) > 0 for ch in chunks if ch.choices) >= 40
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert "short-lived" not in models and "short-lived" not in [r.lora_name for r in engine_loras]


@pytest.mark.parametrize("name,ok", [("sql-v2", True), ("team-a/sql.v2", True), ("org/name:3", True),
                                     ("a/../../b", False), ("a..b", False), ("../x", False), ("a/b/c", False),
                                     (".hidden", False), ("a/", False), ("x" * 201, False), ("sp ace", False)])
def test_adapter_names_follow_the_documented_rule(stack, adapters, name, ok):
    async def go(c):
        return await _load(c, name, adapters["good"])

    answer = run(stack, go)
    assert answer.status_code == (200 if ok else 400), answer.text
    if not ok:
        assert "lora_name" in answer.text and name not in stack[2].catalog._uris


def test_after_a_repoint_returns_new_requests_get_the_new_weights_while_old_ones_finish(stack, adapters):
    """A stream runs on "moving" (demo-sql's weights); "moving" is re-pointed to demo-chat's: a request sent after
    the re-point's 200 answers with demo-chat's text at once, and the stream still finishes whole on the old."""
    server, root = stack[2], adapters["good"].parent
    shutil.copytree(server._demo_adapters["demo-chat"], root / "chat-weights", dirs_exist_ok=True)
    shutil.copytree(adapters["good"], root / "sql-weights", dirs_exist_ok=True)
    greedy = dict(prompt="SELECT", max_tokens=6, temperature=0)

    async def go(c):
        assert (await _load(c, "moving", root / "sql-weights")).status_code == 200
        stream = await c.completions.create(model="moving", stream=True, **{**greedy, "max_tokens": 40},
                                            extra_body={"ignore_eos": True})
        chunks = [await stream.__anext__()]
        assert (await _load(c, "moving", root / "chat-weights")).status_code == 200
        after = await c.completions.create(model="moving", **greedy)
        chunks += [chunk async for chunk in stream]
        want = await c.completions.create(model="demo-chat", **greedy)
        return after, want, chunks

    after, want, chunks = run(stack, go)
    assert after.choices[0].text == want.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert not server._retiring  # the old weights left the engine once the stream was done


def test_a_request_racing_an_unload_is_a_404_not_an_internal_error(stack, adapters):
    """The registry follower and a request both drop the same unloaded adapter at once: one does, the other
    finds it gone; the request is a 404."""
    import asyncio

    from cluster.errors import AdapterNotFoundError
    from cluster.server import GenerateRequest

    server, root = stack[2], adapters["good"].parent
    shutil.copytree(adapters["good"], root / "racing", dirs_exist_ok=True)

    async def go(c):
        assert (await _load(c, "racing", root / "racing")).status_code == 200
        await server.catalog.unregister("racing")  # as another ingress's unload would

        async def request():
            async for _ in server.generate(GenerateRequest("racing", {"max_tokens": 2}, prompt="hi")):
                pass

        return await asyncio.gather(server.sync_registry(), request(), server.sync_registry(),
                                    return_exceptions=True)

    results = run(stack, go)
    assert results[0] is None and results[2] is None, results
    assert isinstance(results[1], AdapterNotFoundError), results
    assert "racing" not in server._loaded and not server._retiring
