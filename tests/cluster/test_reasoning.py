"""Reasoning parsers (cluster/reasoning.py): an output's thinking apart from its answer, whole and streamed."""

from __future__ import annotations

import pytest

from cluster.reasoning import PARSERS, reasoning_parser

R1, QWEN3 = PARSERS["deepseek_r1"], PARSERS["qwen3"]


@pytest.mark.parametrize("parser,text,want", [
    (R1, "Think about it.</think>\n\nThe answer.", ("Think about it.", "The answer.")),
    (R1, "<think>Opened again.</think>Done", ("Opened again.", "Done")),
    (R1, "Still thinking when max_tokens came", ("Still thinking when max_tokens came", "")),
    (R1, "</think>", ("", "")),
    (QWEN3, "<think>\nHmm.\n</think>\n\nYes.", ("\nHmm.\n", "Yes.")),
    (QWEN3, "\n<think>cut short", ("cut short", "")),
    (QWEN3, "Yes, no thinking.", (None, "Yes, no thinking.")),
    (QWEN3, "An answer that mentions </think> in passing", (None, "An answer that mentions </think> in passing")),
    (QWEN3, "<thin", (None, "<thin")),
    (QWEN3, "", (None, "")),
])
def test_a_finished_output_splits(parser, text, want):
    assert parser.split(text, finished=True) == want


@pytest.mark.parametrize("parser", [R1, QWEN3], ids=["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("text", ["<think>a plan</think>\n\nthe answer", "plan</think>answer </think> again",
                                  "no tags at all", "<thi", "  <think>x</thi", "<t>not a tag", "a</th>b</think>c"])
def test_streamed_parts_only_grow_and_end_as_the_whole(parser, text):
    """Every prefix's parts extend the previous prefix's (a stream sends only new characters), and the last
    unfinished split plus the finishing one give the finished output's parts."""
    sent_reasoning, sent_content = "", ""
    for end in range(len(text) + 1):
        reasoning, content = parser.split(text[:end], finished=False)
        assert (reasoning or "").startswith(sent_reasoning) and content.startswith(sent_content), text[:end]
        sent_reasoning, sent_content = reasoning or "", content
    reasoning, content = parser.split(text, finished=True)
    assert (reasoning or "").startswith(sent_reasoning) and content.startswith(sent_content)


def test_a_held_tag_start_is_released_once_it_is_not_one():
    assert R1.split("so x </th", finished=False) == ("so x ", "")
    assert R1.split("so x </thus", finished=False) == ("so x </thus", "")
    assert QWEN3.split("<th", finished=False) == (None, "")
    assert QWEN3.split("<tx", finished=False) == (None, "<tx")


def test_a_grammar_shaped_output_thinks_only_where_it_opens_think():
    grammar = R1.opened_by_output()
    assert grammar.split('{"a": 1}') == (None, '{"a": 1}')
    assert grammar.split("<think>hm</think>{}") == ("hm", "{}")


def test_parser_names():
    assert reasoning_parser(None) is None and reasoning_parser("qwen3") is QWEN3
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        reasoning_parser("r1")
