"""Tool-call parsers for tool_choice "auto" (cluster/tool_parsers.py): what they find in finished outputs, and
how much of a partial one they let stream as content."""

from __future__ import annotations

import pytest

from cluster.server_config import ServerConfig
from cluster.tool_parsers import HermesParser, Llama3JsonParser, MistralParser, PythonicParser, tool_parser


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


@pytest.mark.parametrize("text, calls", [
    ('[get_weather(city="Paris", unit="c")]', [("get_weather", {"city": "Paris", "unit": "c"})]),
    ('[get_weather(city="Paris"), get_time(zone="UTC")]', [("get_weather", {"city": "Paris"}),
                                                           ("get_time", {"zone": "UTC"})]),
    ("[get_time()]", [("get_time", {})]),
    ('[f(xs=[1, -2.5, (3, 4)], opts={"deep": {"on": True, "off": False, "none": None}}, n=+7)]',
     [("f", {"xs": [1, -2.5, [3, 4]], "opts": {"deep": {"on": True, "off": False, "none": None}}, "n": 7})]),
    ("[f(q='a], b(c=1), \"quoted\"', r=\"it's [x]\")]", [("f", {"q": 'a], b(c=1), "quoted"', "r": "it's [x]"})]),
    ('\n [\n  f(s="""two\nlines"""),  # Python\'s own comments and layout\n  g(),\n]\n',
     [("f", {"s": "two\nlines"}), ("g", {})]),
    ('<|python_start|>[get_time(zone="CET")]<|python_end|>', [("get_time", {"zone": "CET"})]),  # Llama 4
    ("<|python_start|> [get_time()]", [("get_time", {})]),
])
def test_pythonic_reads_a_list_of_calls_with_literal_keywords(text, calls):
    assert PythonicParser().parse(text) == (None, calls)


@pytest.mark.parametrize("text", [
    "It is sunny.", "[1, 2, 3]", "[]", '["get_time()"]', "[get_time]",
    '[get_weather("Paris")]',  # positional: a JSON object needs names
    "[tools.get_time()]",  # a dotted name, which vLLM refuses too
    '[f(x="a")', '[f(x="a)]', "[f(x=1)] and then text", "[f(x=1)]; g()", "Sure: [f(x=1)]",  # cut, broken, more
    "[f(x=y)]", "[f(x=true)]", "[f(x=1 + 2)]", '[f(x=f"{y}")]', "[f(x=b'raw')]", "[f(x=1e999)]", "[f(x=1j)]",
    "[f(**kw)]", "[f(x=1, x=2)]", "[f(x={1: 2})]", "[f(x={**d})]", "[f(x=[*xs])]", "[f(x=1) for f in fs]",
    "[f(x=__import__('os').system('true'))]",  # read, never run
])
def test_pythonic_leaves_anything_else_as_text(text):
    assert PythonicParser().parse(text) is None


@pytest.mark.parametrize("partial, content", [
    ("", ""), ("  ", ""), ("[", ""), ("[get_wea", ""), ("[ get_weather (", ""), ('[get_weather(city="Par', ""),
    ("<|python_st", ""), ("<|python_start|>[get", ""),  # each may still be a call list: held
    ("Hello", "Hello"), ("[1, 2", "[1, 2"), ("[]", "[]"), ("[a b", "[a b"), ("[tools.get", "[tools.get"),
    ("[Paris](https://", "[Paris](https://"), ("Sure: [f(", "Sure: [f("),  # none of them can become one: sent
])
def test_pythonic_holds_back_an_output_that_may_be_a_call_list(partial, content):
    parser = PythonicParser()
    assert partial[: parser.content_end(partial)] == content
    if content:  # what went out as content never turns into calls, however the output goes on
        assert parser.parse(partial + "x(a=1)]") is None and parser.parse(partial + "]") is None


def test_the_parser_is_a_server_setting():
    assert ServerConfig().tool_parser is None and isinstance(ServerConfig(tool_call_parser="hermes").tool_parser,
                                                               HermesParser)
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServerConfig(tool_call_parser="nope")
    assert tool_parser("llama3_json") is not None
    assert isinstance(ServerConfig(tool_call_parser="pythonic").tool_parser, PythonicParser)
    assert not PythonicParser.needs_special_tokens  # Llama 4's markers are optional: dropped, the list still reads


def test_hermes_content_is_the_streamed_text_before_the_call():
    """A stream sends the content as it comes: the finished message's content must start with what was sent."""
    text = '  Sure thing.\n<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    parser = HermesParser()
    sent = text[: parser.content_end(text[:9])]
    content, calls = parser.parse(text)
    assert content.startswith(sent) and content == "  Sure thing." and calls == [("f", {})]
