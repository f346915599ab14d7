"""The Serve app's response store (cluster/response_store_actor.py) on real Ray: two ingress apps over one actor
see each other's responses (a follow-up, a retrieve or a delete may land on either), and a missing response is
the same 404, naming its field, through the actor."""

from __future__ import annotations

import openai
import pytest
import ray

from cluster.api import build_api
from cluster.response_store_actor import SharedResponses, get_or_create_response_store
from tests.cluster.api_cases import _client, stack  # noqa: F401  (stack: a fixture)

GREEDY = dict(model="demo-chat", temperature=0, max_output_tokens=4)


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="responses-test")
    yield
    ray.shutdown()


def test_two_ingresses_share_one_store(stack, ray_cluster):
    loop, _, server, _ = stack
    actor = get_or_create_response_store(detached=False, capacity=8)
    assert get_or_create_response_store(detached=False) == actor  # the replicas find the same one by name
    first_app, second_app = (build_api(server, responses=SharedResponses(actor)) for _ in range(2))

    async def go():
        a, b = _client(first_app), _client(second_app)
        first = await a.responses.create(input="Say hello", **GREEDY)
        then = await b.responses.create(input="And then?", previous_response_id=first.id, **GREEDY)
        seen = await b.responses.retrieve(first.id)
        items = await a.responses.input_items.list(then.id, order="asc")
        await b.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError) as gone:
            await a.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError) as missing:
            await a.responses.create(input="?", previous_response_id="resp_nothing", **GREEDY)
        return first, then, seen, items, gone.value, missing.value

    first, then, seen, items, gone, missing = loop.run_until_complete(go())
    assert seen.output_text == first.output_text
    assert then.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert [i.type for i in items.data][:2] == ["message", "message"] and len(items.data) == 3
    assert "resp_" in gone.body["message"] and missing.body["param"] == "previous_response_id"
    assert ray.get(actor.size.remote()) == 1  # the follow-up; the first was deleted
