"""server.dynamic_lora_loading_path: a request naming an unregistered adapter loads <path>/<name> (Ray Serve
LLM's dynamic LoRA loading), over the in-process API stack and the official openai client."""

from __future__ import annotations

import json
import shutil

import openai
import pytest

from cluster.server_config import ServerConfig
from tests.cluster.api_cases import open_stack, run
from tests.cluster.conftest import upload_dir


@pytest.fixture(scope="module")
def dynamic_stack(tmp_path_factory):
    """A server whose adapters root (holding sql-copy, a copy of demo-sql) is its dynamic loading path."""
    root = tmp_path_factory.mktemp("dynamic-root")
    yield from open_stack(tmp_path_factory, dynamic_lora_loading_path=str(root) + "/", adapters_root=root)


def test_an_unregistered_adapter_under_the_path_serves_on_first_request(dynamic_stack):
    async def go(c):
        before = [m.id for m in (await c.models.list()).data]
        out = await c.completions.create(model="sql-copy", prompt="SELECT", max_tokens=4, temperature=0)
        ref = await c.completions.create(model="demo-sql", prompt="SELECT", max_tokens=4, temperature=0)
        after = [m.id for m in (await c.models.list()).data]
        return before, out, ref, after

    before, out, ref, after = run(dynamic_stack, go)
    assert "sql-copy" not in before and "sql-copy" in after  # registered as it was fetched
    assert out.choices[0].text == ref.choices[0].text  # the same weights as demo-sql
    server, root = dynamic_stack[2], dynamic_stack[3]
    assert server.catalog._uris["sql-copy"] == f"{root}/sql-copy"


def test_names_with_nothing_under_the_path_are_404s_and_the_server_serves_on(dynamic_stack):
    async def go(c):
        errors = []
        for model in ("no-such-adapter", "../sql-copy", "sub/dir", ".hidden"):
            with pytest.raises(openai.NotFoundError) as info:
                await c.completions.create(model=model, prompt="hi", max_tokens=2)
            errors.append(str(info.value))
        ok = await c.completions.create(model="demo-sql", prompt="hi", max_tokens=2)
        return errors, ok

    errors, ok = run(dynamic_stack, go)
    assert "holds no adapter" in errors[0] and str(dynamic_stack[3]) in errors[0]
    assert all("not a name that dynamic loading takes" in e for e in errors[1:])
    assert ok.usage.completion_tokens == 2
    assert not dynamic_stack[2]._loading  # names that never loaded leave no lock behind


def test_concurrent_first_requests_share_one_load(dynamic_stack):
    """Eight requests at once for an adapter no replica holds yet: one fetch, one engine load, eight answers,
    and no lock left behind."""
    import asyncio

    from cluster.server import ADAPTER_TIER_LOAD

    server, root = dynamic_stack[2], dynamic_stack[3]
    shutil.copytree(root / "sql-copy", root / "sql-twin")
    fetches, loads = server.catalog.origin_fetches, server.adapter_events[ADAPTER_TIER_LOAD]

    async def go(c):
        return await asyncio.gather(*(c.completions.create(model="sql-twin", prompt="SELECT", max_tokens=3,
                                                           temperature=0) for _ in range(8)))

    outs = run(dynamic_stack, go)
    assert len({o.choices[0].text for o in outs}) == 1
    assert server.catalog.origin_fetches - fetches == 1 and server.adapter_events[ADAPTER_TIER_LOAD] - loads == 1
    assert not server._loading


def _refused(stack, model: str) -> tuple[str, list[str]]:
    """(the 400's message for a request naming model, the models listed after it)."""
    async def go(c):
        with pytest.raises(openai.BadRequestError) as info:
            await c.completions.create(model=model, prompt="hi", max_tokens=2)
        return str(info.value), [m.id for m in (await c.models.list()).data]
    return run(stack, go)


def test_a_broken_adapter_under_the_path_is_refused_and_not_registered(dynamic_stack):
    root = dynamic_stack[3]
    broken = root / "broken"
    shutil.copytree(root / "sql-copy", broken)
    config = json.loads((broken / "adapter_config.json").read_text())
    (broken / "adapter_config.json").write_text(json.dumps({**config, "r": 64, "lora_alpha": 128}))
    message, models = _refused(dynamic_stack, "broken")
    assert "adapter_config.json" in message and "broken" not in models


def test_an_adapter_this_deployment_cannot_serve_never_registers(dynamic_stack):
    """A well-formed adapter whose rank is above the engines' max_lora_rank (32): the catalog checks it against
    the deployment's AdapterFit before registering it, so a 400 naming the rank, and /v1/models does not list
    an adapter that cannot serve."""
    from safetensors.torch import save_file

    from replicas.demo_checkpoint import _PEFT_DEFAULTS, adapter_weights

    fields = dict(r=64, lora_alpha=64, target_modules=["q_proj", "v_proj"])
    wide = dynamic_stack[3] / "wide-r64"
    wide.mkdir()
    save_file(adapter_weights(fields, seed=5), str(wide / "adapter_model.safetensors"))
    (wide / "adapter_config.json").write_text(json.dumps({**_PEFT_DEFAULTS, **fields}))
    message, models = _refused(dynamic_stack, "wide-r64")
    assert "max_lora_rank" in message and "wide-r64" not in models
    assert "wide-r64" not in dynamic_stack[2].catalog._uris


def test_adapters_under_an_s3_prefix(tmp_path_factory, s3_env, s3_client):
    """The path as an S3 prefix on a real S3 server (SeaweedFS): s3://bucket/loras/<name>."""
    from replicas.demo_checkpoint import ensure_demo_checkpoint

    s3_client.create_bucket(Bucket="dynamic")
    upload_dir(s3_client, "dynamic", "loras/sql-s3", ensure_demo_checkpoint().adapters["demo-sql"])
    stack_gen = open_stack(tmp_path_factory, sources={"s3_endpoint_url": s3_env.endpoint_url},
                           dynamic_lora_loading_path="s3://dynamic/loras")
    stack = next(stack_gen)
    fetched = stack[2].catalog.origin_fetches  # the demo's adapters, registered at start
    try:
        async def go(c):
            out = await c.completions.create(model="sql-s3", prompt="SELECT", max_tokens=4, temperature=0)
            ref = await c.completions.create(model="demo-sql", prompt="SELECT", max_tokens=4, temperature=0)
            with pytest.raises(openai.NotFoundError, match="s3://dynamic/loras/sql-missing holds no adapter"):
                await c.completions.create(model="sql-missing", prompt="SELECT", max_tokens=4)
            return out, ref

        out, ref = run(stack, go)
        assert out.choices[0].text == ref.choices[0].text
        assert stack[2].catalog.origin_fetches - fetched == 1  # sql-s3, once; nothing for the missing one
        assert stack[2].catalog._uris["sql-s3"] == "s3://dynamic/loras/sql-s3"
    finally:
        next(stack_gen, None)


def test_the_path_must_be_a_prefix():
    with pytest.raises(ValueError, match="dynamic_lora_loading_path"):
        ServerConfig(dynamic_lora_loading_path="/")
    assert ServerConfig(dynamic_lora_loading_path="s3://bucket/loras/").dynamic_lora_loading_path == \
        "s3://bucket/loras"
