"""Tool-call parsers for tool_choice "auto" (cluster/tool_parsers.py): what they find in finished outputs, and
how much of a partial one they let stream as content."""

from __future__ import annotations

import pytest

from cluster.server import ServerConfig
from cluster.tool_parsers import HermesParser, Llama3JsonParser, MistralParser, tool_parser


def test_hermes_finds_each_block_after_the_content():
    text = ('Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}')  # the last one unclosed
    assert HermesParser().parse(text) == ("Let me look.", [("get_time", {"zone": "UTC"}),
                                                            ("get_weather", {"city": "Oslo"})])
    assert HermesParser().parse("<tool_call>{}</tool_call>") is None  # no name: not a call
    assert HermesParser().parse('<tool_call>{"name": "f", "arguments": {"a": </tool_call>') is None  # broken JSON
    assert HermesParser().parse("No call here, <tool> is a word.") is None


@pytest.mark.parametrize("partial, content", [
    ("Hello", "Hello"), ("Hello <tool", "Hello "), ("Hello <", "Hello "), ("a<b", "a<b"),
    ("Sure. <tool_call>{\"na", "Sure. "), ("", ""),
])
def test_hermes_streams_what_cannot_start_a_call(partial, content):
    assert partial[: HermesParser().content_end(partial)] == content


def test_llama3_json_reads_calls_that_make_the_whole_output():
    parser = Llama3JsonParser()
    assert parser.parse('{"name": "get_time", "parameters": {"zone": "CET"}}; {"name": "f", "arguments": {}}') == \
        (None, [("get_time", {"zone": "CET"}), ("f", {})])
    assert parser.parse('<|python_tag|>{"name": "f", "parameters": {"x": 1}}') == (None, [("f", {"x": 1})])
    assert parser.parse("The answer is {42}.") is None
    assert parser.parse('{"name": "f", "parameters": {"x": 1}} and then text') is None
    assert parser.parse('{"name": "f", "parameters": {"x": ') is None  # cut


@pytest.mark.parametrize("partial, streamed", [
    ("", 0), ("  ", 0), ("{", 0), ('{"name"', 0), ("<|py", 0), ("<|python_tag|>{", 0), ("Hello", 5), ("<b>", 3),
])
def test_llama3_json_holds_back_an_output_that_may_be_a_call(partial, streamed):
    assert Llama3JsonParser().content_end(partial) == streamed


def test_mistral_reads_both_of_its_formats_after_the_special_token():
    parser = MistralParser()
    v3 = 'Checking.[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "f", "arguments": {}}]'
    assert parser.parse(v3) == ("Checking.", [("get_time", {"zone": "UTC"}), ("f", {})])
    v11 = '[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'
    assert parser.parse(v11) == (None, [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo"})])
    assert parser.parse('[TOOL_CALLS]{"name": "f", "arguments": "{\\"x\\": 1}"}') == (None, [("f", {"x": 1})])
    assert parser.parse("No calls, [TOOL] is text.") is None
    assert parser.parse('[TOOL_CALLS][{"name": "f", "arguments": {"x": ') is None  # cut by max_tokens
    assert parser.parse("[TOOL_CALLS]f[ARGS]{oops}") is None and parser.parse("[TOOL_CALLS]") is None
    assert parser.needs_special_tokens and not HermesParser().needs_special_tokens


@pytest.mark.parametrize("partial, content", [
    ("Hello", "Hello"), ("Hello [TOOL", "Hello "), ("Hi [", "Hi "), ("[x]", "[x]"), ("So.[TOOL_CALLS][{", "So."),
])
def test_mistral_streams_what_cannot_start_a_call(partial, content):
    assert partial[: MistralParser().content_end(partial)] == content


def test_the_parser_is_a_server_setting():
    assert ServerConfig().tool_parser is None and isinstance(ServerConfig(tool_call_parser="hermes").tool_parser,
                                                               HermesParser)
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServerConfig(tool_call_parser="nope")
    assert tool_parser("llama3_json") is not None


def test_hermes_content_is_the_streamed_text_before_the_call():
    """A stream sends the content as it comes: the finished message's content must start with what was sent."""
    text = '  Sure thing.\n<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    parser = HermesParser()
    sent = text[: parser.content_end(text[:9])]
    content, calls = parser.parse(text)
    assert content.startswith(sent) and content == "  Sure thing." and calls == [("f", {})]
