"""A module-scoped in-process API stack (LoRAServer + the FastAPI app on its own event loop) and a runner that
drives it with the official openai client over ASGI; shared by test_api.py and test_api_sampling.py."""

from __future__ import annotations

import asyncio
import shutil

import httpx
import openai
import pytest

from cluster.api import build_api
from cluster.catalog import LocalCatalog
from cluster.server import LoRAServer
from cluster.server_config import ServerConfig
from cluster.sources import SourceSettings

ENGINE = dict(dtype="float32", device="cpu", max_loras=2, max_lora_rank=32, num_kv_blocks=128)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """(loop, app, server, adapters root): one server for the module, on its own event loop."""
    yield from open_stack(tmp_path_factory)


def open_stack(tmp_path_factory, adapters_root=None, sources=None, **server_config):
    """The stack's generator, for a fixture of a server with other ServerConfig settings (adapters_root: the
    directory the local adapters lie in, sql-copy among them, default a fresh one; sources: more
    SourceSettings fields)."""
    cache = tmp_path_factory.mktemp("cache")
    root = adapters_root or tmp_path_factory.mktemp("adapters")
    mp = pytest.MonkeyPatch()
    mp.setenv("LORAFLEET_CACHE", str(cache))
    loop = asyncio.new_event_loop()
    from replicas.demo_checkpoint import ensure_demo_checkpoint

    demo = ensure_demo_checkpoint()
    settings = SourceSettings(allowed_local_roots=[str(root), str(cache)], **(sources or {}))
    server = LoRAServer(ServerConfig(model="demo", engine=ENGINE, default_max_tokens=8, **server_config),
                        LocalCatalog(settings))
    loop.run_until_complete(server.start())
    shutil.copytree(demo.adapters["demo-sql"], root / "sql-copy")
    app = build_api(server, api_keys=None)
    yield loop, app, server, root
    loop.run_until_complete(server.shutdown())
    loop.close()
    mp.undo()


def _client(app, **kw) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")
    return openai.AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key=kw.get("api_key", "none"), http_client=http,
                              max_retries=0)


def run(stack, coro_fn):
    loop, app = stack[0], stack[1]
    return loop.run_until_complete(coro_fn(_client(app)))
