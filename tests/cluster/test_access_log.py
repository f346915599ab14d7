"""A client error is one log line (request id, route, status, adapter), never a traceback; the request-count
metric is labelled by route template, so random paths mint no new series."""

from __future__ import annotations

import logging

import pytest

from tests.cluster.api_cases import run


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from tests.cluster.api_cases import open_stack

    yield from open_stack(tmp_path_factory)


def _post(c, path: str, body: dict, **headers):
    return c._client.post(f"http://127.0.0.1{path}", json=body, headers=headers)


def test_each_client_error_is_one_line_without_a_traceback(stack, caplog):
    async def go(c):
        missing = await _post(c, "/v1/completions", {"model": "nope", "prompt": "hi", "max_tokens": 2},
                              **{"X-Request-Id": "req-42"})
        bad = await _post(c, "/v1/completions", {"model": "demo-sql", "prompt": "hi", "temperature": -1})
        ok = await _post(c, "/v1/completions", {"model": "demo-sql", "prompt": "hi", "max_tokens": 2})
        return missing, bad, ok

    with caplog.at_level(logging.INFO):
        missing, bad, ok = run(stack, go)
    assert (missing.status_code, bad.status_code, ok.status_code) == (404, 400, 200)
    assert missing.headers["x-request-id"] == "req-42" and ok.headers["x-request-id"]
    lines = [r for r in caplog.records if r.name == "lorafleet.access"]
    assert len(lines) == 2 and all(r.levelno == logging.INFO for r in lines), [r.getMessage() for r in lines]
    first, second = (r.getMessage() for r in lines)
    for needle in ('request_id="req-42"', 'route="/v1/completions"', "status=404", 'adapter="nope"', "does not exist"):
        assert needle in first, first
    assert 'adapter="demo-sql"' in second and "status=400" in second and "temperature" in second, second
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], "a traceback was logged"


def test_the_request_metric_names_route_templates(stack):
    async def go(c):
        for path in ("/no/such/path", "/v1/also-not-a-route"):
            await c._client.get(f"http://127.0.0.1{path}")
        return (await c._client.get("http://127.0.0.1/metrics")).text

    text = run(stack, go)
    assert 'route="unmatched",status="404"' in text
    assert "/no/such/path" not in text and "also-not-a-route" not in text
