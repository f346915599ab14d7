"""Reasoning through /v1/chat/completions (server.reasoning_parser) and chat_template_kwargs, driven by the
official openai client over an in-process LoRAServer on the demo model.

The demo's random weights write no thinking of their own, so most outputs here are held to one string by
structured_outputs (a grammar: the output is split only where it opens <think> itself, cluster/reasoning.py);
one free output shows deepseek_r1's rule that a prompt-opened thought runs until </think>.
"""

from __future__ import annotations

import json

import pytest

from tests.cluster.api_cases import open_stack, run

CHAT = dict(model="demo-chat", messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=64,
            temperature=0)
SAID = "<think>It is July; Paris is warm.</think>\n\nIt is sunny."
GET_WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def r1_stack(tmp_path_factory):
    """A server that splits DeepSeek-R1's thinking and reads tool calls in Hermes' syntax."""
    yield from open_stack(tmp_path_factory, reasoning_parser="deepseek_r1", tool_call_parser="hermes")


def _forced(text: str) -> dict:
    return {"structured_outputs": {"choice": [text]}}


def test_thinking_comes_back_apart_from_the_answer(r1_stack):
    async def go(c):
        full = await c.chat.completions.create(**CHAT, extra_body=_forced(SAID))
        chunks = [ch async for ch in await c.chat.completions.create(**CHAT, extra_body=_forced(SAID), stream=True)]
        hidden = await c.chat.completions.create(**CHAT, extra_body={**_forced(SAID), "include_reasoning": False})
        return full, chunks, hidden

    full, chunks, hidden = run(r1_stack, go)
    message = full.choices[0].message
    assert (message.reasoning_content, message.content) == ("It is July; Paris is warm.", "It is sunny.")
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "It is July; Paris is warm."
    assert "".join(d.content or "" for d in deltas) == "It is sunny."
    assert not any("think>" in (d.content or "") + (getattr(d, "reasoning_content", None) or "") for d in deltas)
    assert hidden.choices[0].message.content == "It is sunny."
    assert getattr(hidden.choices[0].message, "reasoning_content", None) is None


def test_a_thought_cut_by_max_tokens_has_no_answer(r1_stack):
    """deepseek_r1: the template opened <think>, so a free output that never closes it is all reasoning."""
    async def go(c):
        return await c.chat.completions.create(**dict(CHAT, max_tokens=6))

    out = run(r1_stack, go)
    message = out.choices[0].message
    assert message.content is None and message.reasoning_content and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 6


def test_tool_calls_are_read_from_the_answer_only(r1_stack):
    said = ('<think>I should call get_weather. <tool_call>not this one</tool_call></think>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>')

    async def go(c):
        return await c.chat.completions.create(**dict(CHAT, max_tokens=128), tools=[GET_WEATHER],
                                               extra_body=_forced(said))

    out = run(r1_stack, go)
    message = out.choices[0].message
    assert message.reasoning_content == "I should call get_weather. <tool_call>not this one</tool_call>"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    assert out.choices[0].finish_reason == "tool_calls" and not message.content


def test_chat_template_kwargs_reach_the_template(r1_stack, monkeypatch):
    """vLLM's chat_template_kwargs (Qwen3's enable_thinking) are the template's variables, in /tokenize and in
    the chat route alike; a name the request sets itself is a 400."""
    server = r1_stack[2]
    template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                "{% if enable_thinking is defined and not enable_thinking %} /no_think{% endif %}")
    monkeypatch.setattr(server.tokenizer, "chat_template", template)
    messages = [{"role": "user", "content": "hi"}]

    async def go(c):
        http = c._client
        on = await http.post("http://127.0.0.1/tokenize", json={"messages": messages})
        off = await http.post("http://127.0.0.1/tokenize", json={"messages": messages,
                                                                  "chat_template_kwargs": {"enable_thinking": False}})
        bad = await http.post("http://127.0.0.1/tokenize", json={"messages": messages,
                                                                  "chat_template_kwargs": {"messages": []}})
        chat = await c.chat.completions.create(model="demo-chat", messages=messages, max_tokens=1,
                                               extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        bad_chat = await http.post("http://127.0.0.1/v1/chat/completions", json={
            "model": "demo-chat", "messages": messages, "chat_template_kwargs": {"tools": []}})
        return on, off, bad, chat, bad_chat

    on, off, bad, chat, bad_chat = run(r1_stack, go)
    tok = server.tokenizer
    assert on.json()["tokens"] == tok.encode("hi", add_special_tokens=False)
    assert off.json()["tokens"] == tok.encode("hi /no_think", add_special_tokens=False)
    assert chat.usage.prompt_tokens == off.json()["count"]
    for response in (bad, bad_chat):
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == "chat_template_kwargs", error
        assert "set by the request's own fields" in error["message"]
