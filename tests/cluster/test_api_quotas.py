"""Token quotas at the ingress (ServerConfig.quotas): a tenant over its rate gets 429 with Retry-After before its
request runs, the others keep being served, and a finished request gives back what it did not use."""

from __future__ import annotations

import pytest

from tests.cluster.api_cases import open_stack, run

KEYS = {"sk-heavy": "heavy", "sk-light": "light"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # by API key: the heavy key may spend 60 tokens at most, then 1 a second; others are unlimited
    quotas = {"by": "api_key", "tenants": {"sk-heavy": {"tokens_per_s": 1, "burst": 60}}}
    gen = open_stack(tmp_path_factory, quotas=quotas)
    loop, app, server, root = next(gen)
    from cluster.api import build_api

    app = build_api(server, api_keys=list(KEYS), **server.config.api_limits())
    yield loop, app, server, root
    next(gen, None)  # the stack's teardown: the server shuts its engine down


def _complete(c, key: str, max_tokens: int):
    return c._client.post("http://127.0.0.1/v1/completions", headers={"Authorization": f"Bearer {key}"},
                          json={"model": "demo-sql", "prompt": "SELECT", "max_tokens": max_tokens})


def test_a_tenant_over_its_quota_gets_429_with_retry_after_and_the_others_are_served(stack):
    async def go(c):
        first = await _complete(c, "sk-heavy", 8)  # reserves ~10, uses what it used
        big = await _complete(c, "sk-heavy", 200)  # far over what is left: refused before it runs
        light = [await _complete(c, "sk-light", 8) for _ in range(3)]
        return first, big, light

    first, big, light = run(stack, go)
    assert first.status_code == 200, first.text
    assert big.status_code == 429 and big.json()["error"]["type"] == "rate_limit_error", big.text
    assert int(big.headers["retry-after"]) >= 1
    assert [r.status_code for r in light] == [200] * 3


def test_bad_quota_config_fails_the_start():
    from cluster.server_config import ServerConfig

    with pytest.raises(ValueError):
        ServerConfig(model="demo", quotas={"by": "colour"})
