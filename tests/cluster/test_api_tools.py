"""Tool calls in /v1/chat/completions (cluster/tool_calls.py), driven by the official openai client over an
in-process LoRAServer: a named function and "required" write their calls through the engine's grammar, so the
demo model's random weights still give calls whose arguments match the tools' schemas."""

from __future__ import annotations

import json

import openai
import pytest

from cluster.protocol import ChatMessage
from cluster.tool_calls import template_messages, tool_plan
from replicas.chat_template import render_chat
from tests.cluster.api_cases import open_stack, run, stack  # noqa: F401  (stack: a fixture)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The forecast for a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                                       "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}}}}
CHAT = dict(model="demo-chat", messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=64,
            temperature=0)


def _check_arguments(name: str, arguments: str) -> None:
    args = json.loads(arguments)  # strict: the arguments go out as valid JSON
    if name == "get_weather":
        assert set(args) == {"city", "days"} and isinstance(args["city"], str) and len(args["city"]) <= 12
        assert isinstance(args["days"], int) and 1 <= args["days"] <= 7
    else:
        assert args in ({"zone": "UTC"}, {"zone": "CET"}, {"zone": "PST"})


def test_a_named_function_is_called_with_arguments_of_its_schema(stack):
    named = {"type": "function", "function": {"name": "get_weather"}}

    async def go(c):
        full = await c.chat.completions.create(**CHAT, tools=[WEATHER, TIME], tool_choice=named)
        chunks = [ch async for ch in await c.chat.completions.create(**CHAT, tools=[WEATHER, TIME],
                                                                      tool_choice=named, stream=True)]
        return full, chunks

    full, chunks = run(stack, go)
    message = full.choices[0].message
    assert message.content is None and full.choices[0].finish_reason == "stop"
    (call,) = message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    _check_arguments("get_weather", call.function.arguments)
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert deltas[0].role == "assistant" and all(not d.content for d in deltas)
    streamed = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert len(streamed) == 1 and streamed[0].index == 0 and streamed[0].function.name == "get_weather"
    assert streamed[0].function.arguments == call.function.arguments  # greedy: the same call, streamed whole


def test_required_calls_one_of_the_tools(stack):
    async def go(c):
        return [await c.chat.completions.create(**dict(CHAT, temperature=1.0, seed=seed), tools=[WEATHER, TIME],
                                                tool_choice="required", parallel_tool_calls=False)
                for seed in range(3)]

    for out in run(stack, go):
        (call,) = out.choices[0].message.tool_calls
        assert call.function.name in ("get_weather", "get_time")
        _check_arguments(call.function.name, call.function.arguments)


def test_none_answers_in_text_and_a_conversation_with_calls_renders(stack):
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'}]

    async def go(c):
        return await c.chat.completions.create(**dict(CHAT, messages=history, max_tokens=4), tools=[WEATHER],
                                               tool_choice="none")

    out = run(stack, go)
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content


@pytest.mark.parametrize("extra, param, words", [
    (dict(tools=[WEATHER]), "tool_choice", "parser"),  # "auto", OpenAI's default once tools are given
    (dict(tools=[WEATHER], tool_choice="auto"), "tool_choice", "parser"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice",
     "not among the tools"),
    (dict(tool_choice="required"), "tool_choice", "needs tools"),
    (dict(tools=[{"type": "function", "function": {}}], tool_choice="required"), "tools", "tools[0]"),
    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "tool_choice",
     "cannot be combined"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(stack, extra, param, words):
    async def go(c):
        with pytest.raises(openai.BadRequestError) as err:
            await c.chat.completions.create(**CHAT, **extra)
        return err.value.body

    body = run(stack, go)
    assert body["param"] == param and words in body["message"], body


def test_calls_read_back_and_messages_as_templates_read_them():
    plan = tool_plan([WEATHER, TIME], "required")
    message = plan.message('[{"name":"get_time","parameters":{"zone":"UTC"}},'
                           '{"name":"get_weather","parameters":{"city":"Oslo","days":2}}]')
    assert message["content"] is None and [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                           for c in message["tool_calls"]] == [
        ("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo", "days": 2})]
    cut = '[{"name":"get_time","parameters":{"zo'
    assert plan.message(cut) == {"content": cut}  # cut by max_tokens: no calls, the text as content
    assert tool_plan([WEATHER], "required", parallel_tool_calls=False).constraint["json"]["maxItems"] == 1
    assert tool_plan([WEATHER], "none") is None and tool_plan(None, None) is None
    messages = template_messages([
        ChatMessage(role="assistant", tool_calls=[{"id": "c", "type": "function",
                                                   "function": {"name": "f", "arguments": '{"a": 1}'}}]),
        ChatMessage(role="tool", tool_call_id="c", name="f", content="42")])
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1} and messages[0]["content"] == ""
    assert messages[1] == {"role": "tool", "content": "42", "tool_call_id": "c", "name": "f"}
    template = "{% if tools %}[{{ tools | length }} tools]{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert render_chat([{"role": "user", "content": "hi"}], template, tools=[WEATHER, TIME]) == "[2 tools]hi"


def _say(c, text, **kw):
    """A chat with both tools under tool_choice "auto" whose output is text: a one-string choice
    (structured_outputs) holds the demo's random weights to it."""
    return c.chat.completions.create(**dict(CHAT, max_tokens=256), tools=[WEATHER, TIME],
                                     extra_body={"structured_outputs": {"choice": [text]}}, **kw)


@pytest.fixture(scope="module")
def hermes_stack(tmp_path_factory):
    """A server that reads tool calls in Hermes' syntax (server.tool_call_parser: hermes)."""
    yield from open_stack(tmp_path_factory, tool_call_parser="hermes")


def test_auto_finds_the_calls_the_model_chose_to_make(hermes_stack):
    """tool_choice "auto" (OpenAI's default with tools) on a server with a parser: the calls the output holds come
    back as tool_calls with finish_reason "tool_calls", the text before them as content; an answer in text stays
    text. The demo's random weights are held to each output by a one-string choice (structured_outputs)."""
    said = ('Let me check. <tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call>')

    async def go(c):
        called = await _say(c, said)
        streamed = [ch async for ch in await _say(c, said, stream=True)]
        plain = await _say(c, "It is sunny.")
        return called, streamed, plain

    called, streamed, plain = run(hermes_stack, go)
    message = called.choices[0].message
    assert called.choices[0].finish_reason == "tool_calls" and message.content == "Let me check."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls] == [
        ("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo", "days": 2})]
    deltas = [ch.choices[0] for ch in streamed if ch.choices]
    assert "".join(d.delta.content or "" for d in deltas).strip() == "Let me check."
    calls = [t for d in deltas for t in (d.delta.tool_calls or [])]
    assert [(t.index, t.function.name) for t in calls] == [(0, "get_time"), (1, "get_weather")]
    assert deltas[-1].finish_reason == "tool_calls"
    assert not any("<tool_call>" in (d.delta.content or "") for d in deltas)  # the call never leaked as text
    assert plain.choices[0].message.content == "It is sunny." and plain.choices[0].message.tool_calls is None
    assert plain.choices[0].finish_reason == "stop"


@pytest.fixture(scope="module")
def mistral_stack(tmp_path_factory):
    """A server that reads tool calls in Mistral's syntax (server.tool_call_parser: mistral)."""
    yield from open_stack(tmp_path_factory, tool_call_parser="mistral")


def test_mistral_calls_are_read_with_special_tokens_kept(mistral_stack, monkeypatch):
    """[TOOL_CALLS] is a special token in Mistral's vocabularies, so the chat route keeps special tokens in the text
    of an "auto" request (what the engine receives); the calls after it come back as tool_calls."""
    server = mistral_stack[2]
    seen = []
    generate = server.generate
    monkeypatch.setattr(server, "generate", lambda request: seen.append(request) or generate(request))
    said = 'Checking.[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]'

    async def go(c):
        called = await c.chat.completions.create(**dict(CHAT, max_tokens=128), tools=[WEATHER, TIME],
                                                 extra_body={"structured_outputs": {"choice": [said]}})
        plain = await c.chat.completions.create(**CHAT)
        return called, plain

    called, plain = run(mistral_stack, go)
    message = called.choices[0].message
    assert called.choices[0].finish_reason == "tool_calls" and message.content == "Checking."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls] == [
        ("get_time", {"zone": "UTC"})]
    assert seen[0].sampling["skip_special_tokens"] is False
    assert seen[1].sampling.get("skip_special_tokens") in (None, True)  # no tools: as the client left it


@pytest.fixture(scope="module")
def pythonic_stack(tmp_path_factory):
    """A server that reads tool calls written as a Python list (server.tool_call_parser: pythonic)."""
    yield from open_stack(tmp_path_factory, tool_call_parser="pythonic")


def test_pythonic_calls_come_back_with_json_arguments(pythonic_stack):
    """Llama 3.2 / Llama 4 write [name(key=value, ...), ...]: each call comes back with its keywords as a JSON
    object, whole or streamed, and the stream never shows the list as text; a list that is no call list stays text."""
    said = '[get_time(zone="UTC"), get_weather(city="Oslo, [N]", days=2)]'

    async def go(c):
        called = await _say(c, said)
        streamed = [ch async for ch in await _say(c, said, stream=True)]
        plain = [ch async for ch in await _say(c, "[1, 2] are the numbers.", stream=True)]
        return called, streamed, plain

    called, streamed, plain = run(pythonic_stack, go)
    expected = [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo, [N]", "days": 2})]
    message = called.choices[0].message
    assert called.choices[0].finish_reason == "tool_calls" and message.content is None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls] == expected
    deltas = [ch.choices[0] for ch in streamed if ch.choices]
    assert not any(d.delta.content for d in deltas)  # the call list never leaked as text
    calls = [t for d in deltas for t in (d.delta.tool_calls or [])]
    assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in calls] == [
        (k, name, args) for k, (name, args) in enumerate(expected)]
    assert deltas[-1].finish_reason == "tool_calls"
    deltas = [ch.choices[0] for ch in plain if ch.choices]
    assert "".join(d.delta.content or "" for d in deltas) == "[1, 2] are the numbers."
    assert sum(bool(d.delta.content) for d in deltas) > 1  # let go once it could be no call list, not at the end
    assert not any(d.delta.tool_calls for d in deltas) and deltas[-1].finish_reason == "stop"
