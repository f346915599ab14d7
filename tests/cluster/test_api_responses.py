"""OpenAI's Responses API (/v1/responses, cluster/responses.py) driven by the official openai client over an
in-process LoRAServer on the demo model.

A response runs as a chat completion, so most checks compare it with /v1/chat/completions at temperature 0 on
the same conversation: the same text, the same prompt length (input_tokens). Where the demo's random weights
would write nothing useful, a grammar (structured_outputs, a forced tool call) fixes the output.
"""

from __future__ import annotations

import contextlib
import json

import httpx
import openai
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from cluster.api import build_api
from replicas.errors import EngineDeadError
from tests.cluster.api_cases import open_stack, run, stack  # noqa: F401  (stack: a fixture)
from tests.cluster.responses_cases import (CHAT_WEATHER, GREEDY, WEATHER, chat_completion as _chat,
                                           create_response as _create)

SAID = "<think>It is July; Paris is warm.</think>\n\nIt is sunny."
EVENTS = TypeAdapter(ResponseStreamEvent)


async def _raw_events(c, **kw) -> list:
    """A streamed response's SSE events, each checked against the SDK's event models and its `event:` name."""
    async with c._client.stream("POST", "http://127.0.0.1/v1/responses", json={**kw, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = "".join([chunk async for chunk in r.aiter_text()])
    events = []
    for block in filter(None, text.split("\n\n")):
        name, data = block.split("\n")
        event = EVENTS.validate_python(json.loads(data.removeprefix("data: ")))
        assert name == f"event: {event.type}"
        events.append(event)
    return events

def test_text_input_answers_as_the_chat_does(stack):
    async def go(c):
        return await _create(c, input="Say hello", **GREEDY), await _chat(c, [{"role": "user", "content": "Say hello"}])

    out, chat = run(stack, go)
    assert out.id.startswith("resp_") and out.object == "response" and out.model == "demo-chat"
    (message,) = out.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [p.type for p in message.content] == ["output_text"] and message.content[0].annotations == []
    assert out.output_text == chat.choices[0].message.content and out.output_text
    assert (out.usage.input_tokens, out.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens
    assert out.temperature == 0 and out.max_output_tokens == 8 and out.tools == [] and out.tool_choice == "auto"


def test_instructions_and_a_message_list_make_the_chat_conversation(stack):
    items = [{"role": "developer", "content": "Answer in French."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"},
                                                              {"type": "input_text", "text": " there"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Bonjour"}]},
             {"role": "user", "content": "And goodbye?"}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "system", "content": "Answer in French."},
                {"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Bonjour"},
                {"role": "user", "content": "And goodbye?"}]

    async def go(c):
        outs = [await _create(c, input=items, **GREEDY), await _create(c, input=items, instructions="Be brief.",
                                                                        **GREEDY)]
        return outs, [await _chat(c, messages[1:]), await _chat(c, messages)]

    outs, chats = run(stack, go)
    for out, chat in zip(outs, chats):
        assert out.output_text == chat.choices[0].message.content
        assert out.usage.input_tokens == chat.usage.prompt_tokens
    assert outs[1].instructions == "Be brief." and outs[0].instructions is None
    assert outs[0].usage.input_tokens != outs[1].usage.input_tokens


def test_an_adapter_answers_as_in_chat(stack):
    async def go(c):
        outs = [await _create(c, input="SELECT", **dict(GREEDY, model=m)) for m in ("demo-sql", "lorafleet-demo")]
        return outs, await _chat(c, [{"role": "user", "content": "SELECT"}], model="demo-sql")

    (sql, base), chat = run(stack, go)
    assert sql.model == "demo-sql" and sql.output_text == chat.choices[0].message.content
    assert sql.output_text != base.output_text  # the adapter changes the output


def test_max_output_tokens_leaves_the_response_incomplete(stack):
    async def go(c):
        cut = await _create(c, input="Say hello", **dict(GREEDY, max_output_tokens=3))
        whole = await _create(c, input="Say hello", **GREEDY, extra_body={"structured_outputs": {"choice": ["yes"]}})
        return cut, whole

    cut, whole = run(stack, go)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3 and cut.output[0].status == "incomplete"
    assert whole.status == "completed" and whole.incomplete_details is None and whole.output_text == "yes"
    assert whole.output[0].status == "completed"


def test_streaming_sends_the_events_of_the_whole_response(stack):
    async def go(c):
        return await _raw_events(c, input="Say hello", **GREEDY), await _create(c, input="Say hello", **GREEDY)

    events, full = run(stack, go)
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and types == (
        ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
        + ["response.output_text.delta"] * len(deltas)
        + ["response.output_text.done", "response.content_part.done", "response.output_item.done",
           "response.completed"])
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    done, completed = events[-4], events[-1].response
    item_id = events[2].item.id
    assert {e.item_id for e in deltas} == {item_id} and completed.output[0].id == item_id
    assert "".join(e.delta for e in deltas) == done.text == completed.output_text == full.output_text
    assert completed.usage.output_tokens == full.usage.output_tokens and completed.status == full.status


def test_a_forced_tool_call_then_its_output(stack):
    named = {"type": "function", "name": "get_weather"}
    ask = [{"role": "user", "content": "Weather in Paris?"}]

    async def go(c):
        call = await _create(c, input=ask, tools=[WEATHER], tool_choice=named, **dict(GREEDY, max_output_tokens=64))
        stream = [e async for e in await c.responses.create(input=ask, tools=[WEATHER], tool_choice=named,
                                                            stream=True, **dict(GREEDY, max_output_tokens=64))]
        (fc,) = call.output
        result = {"type": "function_call_output", "call_id": fc.call_id, "output": '{"sky": "clear"}'}
        # the conversation sent again whole (the call item as it came back), or continued from the stored one
        again = await _create(c, input=[*ask, fc.model_dump(exclude_none=True), result], tools=[WEATHER],
                              tool_choice="none", **GREEDY)
        follow = await _create(c, input=[result], previous_response_id=call.id, tools=[WEATHER],
                               tool_choice="none", **GREEDY)
        chat = await _chat(c, [*ask, {"role": "assistant", "content": None, "tool_calls": [
            {"id": fc.call_id, "type": "function", "function": {"name": fc.name, "arguments": fc.arguments}}]},
            {"role": "tool", "tool_call_id": fc.call_id, "content": '{"sky": "clear"}'}],
            tools=[CHAT_WEATHER], tool_choice="none")
        return call, stream, again, follow, chat

    call, stream, again, follow, chat = run(stack, go)
    (fc,) = call.output
    assert fc.type == "function_call" and fc.name == "get_weather" and fc.status == "completed"
    assert fc.id.startswith("fc_") and fc.call_id.startswith("call_") and call.output_text == ""
    args = json.loads(fc.arguments)
    assert set(args) == {"city", "days"} and 1 <= args["days"] <= 7 and len(args["city"]) <= 12
    assert call.tool_choice.name == "get_weather" and call.tools[0].name == "get_weather"
    types = [e.type for e in stream]
    assert types[2:-1] == ["response.output_item.added", "response.function_call_arguments.delta",
                           "response.function_call_arguments.done", "response.output_item.done"]
    assert stream[3].delta == stream[4].arguments == stream[5].item.arguments == fc.arguments  # greedy: the same
    for out in (again, follow):
        assert out.output_text == chat.choices[0].message.content
        assert out.usage.input_tokens == chat.usage.prompt_tokens


def test_a_json_schema_text_format_gives_json_of_that_schema(stack):
    schema = {"type": "object", "additionalProperties": False, "required": ["ok"],
              "properties": {"ok": {"type": "boolean"}}}
    tok = stack[2].tokenizer
    # JSON may hold any whitespace between tokens, which random weights would write on: the JSON's own tokens
    # are pushed up, wherever the grammar lets them in
    push = {str(t): 40 for text in ('"', "}", ":", "true", "false") for t in tok.encode(text, add_special_tokens=False)}
    ask = [{"role": "user", "content": "Answer in JSON"}]
    kw = dict(GREEDY, max_output_tokens=24)

    async def go(c):
        outs, chats = [], []
        for fmt, chat_fmt in [({"type": "json_schema", "name": "answer", "schema": schema, "strict": True},
                               {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}),
                              ({"type": "json_object"}, {"type": "json_object"})]:
            outs.append(await _create(c, input=ask, text={"format": fmt}, **kw, extra_body={"logit_bias": push}))
            chats.append(await _chat(c, ask, max_tokens=24, response_format=chat_fmt, logit_bias=push))
        return outs, chats

    outs, chats = run(stack, go)
    assert [o.output_text for o in outs] == [ch.choices[0].message.content for ch in chats]
    assert isinstance(json.loads(outs[0].output_text)["ok"], bool) and outs[0].status == "completed"
    assert outs[0].text.format.type == "json_schema" and outs[0].text.format.name == "answer"
    assert outs[1].text.format.type == "json_object"


@pytest.mark.parametrize("extra, error, needle", [
    ({"model": "no-such-adapter"}, openai.NotFoundError, "no-such-adapter"),
    ({"temperature": -1}, openai.BadRequestError, "temperature"),
    ({"tools": [{"type": "web_search"}]}, openai.BadRequestError, "'web_search' are not supported"),
    ({"tools": [WEATHER]}, openai.BadRequestError, "tool-call parser"),  # "auto", and this server has none
    ({"tools": [CHAT_WEATHER], "tool_choice": "required"}, openai.BadRequestError, "flat"),
    ({"tool_choice": "sometimes"}, openai.BadRequestError, "tool_choice must be"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     openai.BadRequestError, "input_image"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, openai.BadRequestError, "item_reference"),
    ({"input": [{"role": "robot", "content": "hi"}]}, openai.BadRequestError, "role"),
    ({"input": [{"type": "function_call", "name": "f"}]}, openai.BadRequestError, "call_id"),
    ({"input": []}, openai.BadRequestError, "no message"),
    ({"previous_response_id": "resp_nope"}, openai.NotFoundError, "resp_nope"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, openai.BadRequestError, "schema"),
    ({"background": True}, openai.BadRequestError, "background"),
    ({"truncation": "auto"}, openai.BadRequestError, "truncation"),
    ({"conversation": "conv_1"}, openai.BadRequestError, "previous_response_id"),
    ({"extra_body": {"top_k": "many"}}, openai.BadRequestError, "top_k"),
])
def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(stack, extra, error, needle):
    async def go(c):
        with pytest.raises(error, match=needle):
            await c.responses.create(**{"input": "hi", **GREEDY, **extra})
        return await _create(c, input="hi", **GREEDY)

    assert run(stack, go).status in ("completed", "incomplete")


def test_an_error_after_the_stream_opened_comes_in_band(stack):
    loop, _, server, _ = stack

    class DiesMidway:
        def __getattr__(self, name):
            return getattr(server, name)

        async def generate(self, request):
            async with contextlib.aclosing(server.generate(request)) as outs:
                async for out in outs:
                    yield out
                    raise EngineDeadError("the engine stopped")

    app = build_api(DiesMidway())

    async def go():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")
        c = openai.AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key="none", http_client=http, max_retries=0)
        return await _raw_events(c, input="Say hello", **GREEDY)

    events = loop.run_until_complete(go())
    assert events[0].type == "response.created" and events[-1].type == "error"
    assert "engine stopped" in events[-1].message and events[-1].code == "service_unavailable"
    assert not any(e.type == "response.completed" for e in events)


@pytest.fixture(scope="module")
def r1_stack(tmp_path_factory):
    """A server that splits DeepSeek-R1's thinking and reads tool calls in Hermes' syntax."""
    yield from open_stack(tmp_path_factory, reasoning_parser="deepseek_r1", tool_call_parser="hermes")


def test_reasoning_comes_as_its_own_item(r1_stack):
    forced = {"structured_outputs": {"choice": [SAID]}}
    kw = dict(GREEDY, max_output_tokens=64)

    async def go(c):
        return await _create(c, input="Weather?", **kw, extra_body=forced), \
            await _raw_events(c, input="Weather?", **kw, **forced)

    out, events = run(r1_stack, go)
    reasoning, message = out.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.summary == []
    assert [(p.type, p.text) for p in reasoning.content] == [("reasoning_text", "It is July; Paris is warm.")]
    assert out.output_text == "It is sunny." and message.type == "message"
    thought = out.usage.output_tokens_details.reasoning_tokens
    assert 0 < thought < out.usage.output_tokens
    types = [e.type for e in events]
    assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning.content[0].text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "It is sunny."
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message"] and final.output_text == "It is sunny."
    assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1]


def test_auto_tool_calls_are_found_in_the_answer(r1_stack):
    said = ('<think>Call it.</think>Let me look.'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>')

    async def go(c):
        kw = dict(GREEDY, max_output_tokens=128, tools=[WEATHER])
        return await _create(c, input="Weather?", **kw, extra_body={"structured_outputs": {"choice": [said]}}), \
            await _raw_events(c, input="Weather?", **kw, structured_outputs={"choice": [said]})

    out, events = run(r1_stack, go)
    assert [i.type for i in out.output] == ["reasoning", "message", "function_call"]
    assert out.output_text == "Let me look." and json.loads(out.output[2].arguments) == {"city": "Paris", "days": 2}
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[2].arguments == out.output[2].arguments and final.output_text == "Let me look."
