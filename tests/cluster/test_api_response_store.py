"""The Responses API's stored responses (cluster/responses.py, cluster/response_store.py) driven by the official
openai client over an in-process LoRAServer on the demo model: previous_response_id, retrieve, delete, the input
items and their pages, the store's LRU, and a store that fails.
"""

from __future__ import annotations

import json

import openai
import pytest
from openai.types.responses import (ResponseFunctionToolCallItem, ResponseFunctionToolCallOutputItem,
                                    ResponseInputMessageItem, ResponseOutputMessage)

from cluster.response_store import ResponseStore
from tests.cluster.api_cases import run, stack  # noqa: F401  (stack: a fixture)
from tests.cluster.responses_cases import (GREEDY, WEATHER, chat_completion as _chat, create_response as _create,
                                           list_input_items as _input_items)


def test_previous_response_id_continues_the_stored_conversation(stack):
    async def go(c):
        first = await _create(c, input="Hi", instructions="Be brief.", **GREEDY)
        second = await _create(c, input="And then?", previous_response_id=first.id, **GREEDY)
        third = await _create(c, input=[{"role": "user", "content": "Last one"}], previous_response_id=second.id,
                              **GREEDY)
        said = [first.output_text, second.output_text]
        # instructions are not carried over (OpenAI's rule): the earlier turns' input and output are
        chat = await _chat(c, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": said[0]},
                               {"role": "user", "content": "And then?"}, {"role": "assistant", "content": said[1]},
                               {"role": "user", "content": "Last one"}])
        return first, second, third, chat

    first, second, third, chat = run(stack, go)
    assert second.previous_response_id == first.id
    assert first.usage.input_tokens < second.usage.input_tokens < third.usage.input_tokens
    assert third.output_text == chat.choices[0].message.content
    assert third.usage.input_tokens == chat.usage.prompt_tokens


def test_retrieve_returns_the_stored_response_and_store_false_keeps_none(stack):
    async def go(c):
        kept = await _create(c, input="Hi", **GREEDY)
        streamed = [e async for e in await c.responses.create(input="Hi", stream=True, **GREEDY)][-1].response
        unkept = await _create(c, input="Hi", store=False, **GREEDY)
        got = [await c.responses.retrieve(r.id) for r in (kept, streamed)]
        with pytest.raises(openai.NotFoundError, match="not found") as missing:
            await c.responses.retrieve(unkept.id)
        with pytest.raises(openai.NotFoundError) as unknown_previous:
            await c.responses.create(input="Hi", previous_response_id=unkept.id, **GREEDY)
        return kept, streamed, got, missing.value, unknown_previous.value

    kept, streamed, got, missing, unknown_previous = run(stack, go)
    assert got[0].model_dump() == kept.model_dump() and got[1].model_dump() == streamed.model_dump()
    assert missing.status_code == 404
    assert unknown_previous.body["param"] == "previous_response_id"


def test_delete_forgets_a_response_and_its_followers_keep_their_conversation(stack):
    async def go(c):
        first, other = await _create(c, input="Hi", **GREEDY), await _create(c, input="Hi", **GREEDY)
        child = await _create(c, input="And then?", previous_response_id=first.id, **GREEDY)
        raw = await c.responses.with_raw_response.delete(first.id)
        parsed = await c.responses.delete(other.id)  # the SDK's method reads no body: None
        gone = []
        for attempt in (lambda: c.responses.retrieve(first.id), lambda: c.responses.delete(first.id),
                        lambda: c.responses.input_items.list(first.id),
                        lambda: c.responses.create(input="Hi", previous_response_id=first.id, **GREEDY)):
            with pytest.raises(openai.NotFoundError) as missing:
                await attempt()
            gone.append(missing.value)
        return first, child, raw, parsed, gone, await c.responses.retrieve(child.id), await _input_items(c, child.id)

    first, child, raw, parsed, gone, child_again, child_items = run(stack, go)
    assert raw.status_code == 200 and json.loads(raw.text) == {"id": first.id, "object": "response.deleted",
                                                               "deleted": True}
    assert parsed is None
    assert [e.status_code for e in gone] == [404] * 4 and all("deleted" in e.message for e in gone)
    assert gone[3].body["param"] == "previous_response_id"
    assert child_again.model_dump() == child.model_dump()
    assert [i.id for i in child_items.data][1] == first.output[0].id  # still listed: the child's own copy


def test_input_items_of_a_string_input(stack):
    async def go(c):
        out = await _create(c, input="Say hello", **GREEDY)
        return out, await _input_items(c, out.id), await c.responses.input_items.list(out.id)

    out, items, page = run(stack, go)
    (item,) = items.data
    assert isinstance(item, ResponseInputMessageItem) and item.id.startswith("msg_") and item.id != out.output[0].id
    assert item.role == "user" and item.status == "completed"
    assert [(p.type, p.text) for p in item.content] == [("input_text", "Say hello")]
    assert items.object == "list" and items.first_id == items.last_id == item.id and items.has_more is False
    assert [i.id for i in page.data] == [item.id]


def test_input_items_of_a_message_list_with_a_tool_call(stack):
    items = [{"role": "developer", "content": "Answer in French."},
             {"type": "message", "role": "user", "id": "msg_mine",
              "content": [{"type": "input_text", "text": "Weather"}, {"type": "input_text", "text": " in Paris?"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": '{"sky": "clear"}'}]

    async def go(c):
        out = await _create(c, input=items, tools=[WEATHER], tool_choice="none", **GREEDY)
        return await _input_items(c, out.id, order="asc"), await _input_items(c, out.id)

    asc, desc = run(stack, go)
    developer, user, assistant, call, result = asc.data
    assert [type(i) for i in asc.data] == [ResponseInputMessageItem, ResponseInputMessageItem, ResponseOutputMessage,
                                           ResponseFunctionToolCallItem, ResponseFunctionToolCallOutputItem]
    assert developer.role == "developer" and developer.content[0].text == "Answer in French."
    assert user.id == "msg_mine" and [p.text for p in user.content] == ["Weather", " in Paris?"]
    assert assistant.id.startswith("msg_") and assistant.content[0].type == "output_text"
    assert assistant.content[0].annotations == [] and assistant.status == "completed"
    assert call.id.startswith("fc_") and call.status == "completed"
    assert (call.call_id, call.name, call.arguments) == ("call_1", "get_weather", '{"city": "Paris"}')
    assert result.id.startswith("fco_") and (result.call_id, result.output) == ("call_1", '{"sky": "clear"}')
    assert [i.id for i in desc.data] == [i.id for i in reversed(asc.data)]  # desc, OpenAI's default
    assert (desc.first_id, desc.last_id) == (result.id, developer.id)


def test_input_items_of_a_continued_response_list_the_whole_conversation(stack):
    async def go(c):
        first = await _create(c, input="Hi", instructions="Be brief.", **GREEDY)
        second = await _create(c, input=[{"role": "user", "content": "And then?"}], previous_response_id=first.id,
                               **GREEDY)
        return first, second, await _input_items(c, first.id), await _input_items(c, second.id, order="asc")

    first, second, first_items, second_items = run(stack, go)
    (hi,) = first_items.data
    said_hi, said, then = second_items.data  # instructions are no item: they were not carried over
    assert said_hi.id == hi.id and said_hi.content[0].text == "Hi"
    assert isinstance(said, ResponseOutputMessage) and said.model_dump() == first.output[0].model_dump()
    assert then.role == "user" and then.content[0].text == "And then?" and then.id not in (hi.id, said.id)


def test_input_items_come_in_pages(stack):
    said = [{"role": "user", "content": f"Line {i}"} for i in range(5)]

    async def go(c):
        out = await _create(c, input=said, **GREEDY)
        every = (await _input_items(c, out.id, order="asc")).data
        pages, after = [], None
        while after is None or pages[-1].has_more:
            pages.append(await _input_items(c, out.id, order="asc", limit=2, **({"after": after} if after else {})))
            after = pages[-1].last_id
        newest = await _input_items(c, out.id, limit=2, after=every[3].id)
        walked = [i.id async for i in c.responses.input_items.list(out.id, limit=2, order="asc")]
        return every, pages, newest, walked

    every, pages, newest, walked = run(stack, go)
    ids = [i.id for i in every]
    assert [i.content[0].text for i in every] == [f"Line {i}" for i in range(5)] and len(set(ids)) == 5
    assert [[i.id for i in p.data] for p in pages] == [ids[:2], ids[2:4], ids[4:]]
    assert [p.has_more for p in pages] == [True, True, False]
    assert [i.id for i in newest.data] == [ids[2], ids[1]] and newest.has_more  # desc: the items before it
    assert walked == ids  # the SDK's auto-pagination follows last_id


@pytest.mark.parametrize("query, param", [
    ({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"extra_query": {"limit": "many"}}, "limit"),
    ({"order": "sideways"}, "order"), ({"after": "msg_nope"}, "after"),
])
def test_bad_input_item_queries_get_a_400_naming_the_field(stack, query, param):
    async def go(c):
        out = await _create(c, input="Hi", **GREEDY)
        with pytest.raises(openai.BadRequestError, match=param) as bad:
            await c.responses.input_items.list(out.id, **query)
        with pytest.raises(openai.NotFoundError, match="resp_nope"):
            await c.responses.input_items.list("resp_nope")
        return bad.value, await _input_items(c, out.id, limit=100, include=["message.input_image.image_url"])

    bad, listed = run(stack, go)
    assert bad.body["param"] == param and len(listed.data) == 1


def test_an_item_id_already_in_the_conversation_is_refused(stack):
    async def go(c):
        first = await _create(c, input="Hi", **GREEDY)
        again = [first.output[0].model_dump(exclude_none=True), {"role": "user", "content": "More"}]
        twice = [{"id": "msg_1", "role": "user", "content": "a"}, {"id": "msg_1", "role": "user", "content": "b"}]
        errors = []
        for kw in ({"input": again, "previous_response_id": first.id}, {"input": twice}):
            with pytest.raises(openai.BadRequestError, match="already in the conversation") as refused:
                await c.responses.create(**GREEDY, **kw)
            errors.append(refused.value)
        return errors, await _create(c, input=again[1:], previous_response_id=first.id, **GREEDY)

    errors, fine = run(stack, go)
    assert [e.body["param"] for e in errors] == ["input[0].id", "input[1].id"] and fine.status


def test_the_store_drops_the_least_recently_used():
    store = ResponseStore(capacity=2)
    for rid in ("resp_a", "resp_b"):
        store.put({"id": rid}, [])
    store.get("resp_a")  # read: now the most recent
    store.put({"id": "resp_c"}, [])
    assert store.get("resp_a").response == {"id": "resp_a"} and store.get("resp_c") and len(store) == 2
    with pytest.raises(KeyError, match="resp_b"):
        store.get("resp_b")
    store.delete("resp_a")
    with pytest.raises(KeyError, match="resp_a"):
        store.delete("resp_a")
    assert len(store) == 1
    with pytest.raises(ValueError):
        ResponseStore(capacity=0)


def test_a_store_that_fails_loses_no_answer(stack):
    """The store is a cache: when it cannot keep a response (its actor gone), the answer still goes out, streamed
    or not, and is then simply not found."""
    from cluster.api import build_api
    from cluster.response_store import LocalResponses
    from tests.cluster.api_cases import _client

    class Broken(LocalResponses):
        async def put(self, response, inputs):
            raise RuntimeError("the store's actor died")

    app = build_api(stack[2], responses=Broken())

    async def go():
        c = _client(app)
        out = await c.responses.create(input="Say hello", **GREEDY)
        streamed = [e.type async for e in await c.responses.create(input="Say hello", stream=True, **GREEDY)]
        with pytest.raises(openai.NotFoundError):
            await c.responses.retrieve(out.id)
        return out, streamed

    out, streamed = stack[0].run_until_complete(go())
    assert out.status in ("completed", "incomplete") and out.output_text
    assert streamed[-1] == "response.completed"
