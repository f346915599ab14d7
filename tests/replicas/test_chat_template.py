"""Chat templates render as transformers' apply_chat_template renders them (replicas/chat_template.py)."""

from __future__ import annotations

import json
from datetime import datetime, timedelta

import pytest

from replicas.chat_template import render_chat
from replicas.errors import InvalidRequestError

TOOLS = [{"type": "function", "function": {"name": "look_up", "description": "Find 'x' in <docs> & notes, naïvely",
                                           "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Où est <b>? It's 'here'."},
            {"role": "assistant", "content": "Là."}, {"role": "user", "content": "Merci"}]
# What transformers' environment gives templates beyond Jinja's: its tojson (with json.dumps' arguments),
# {% break %}, {% generation %} blocks.
TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}\n{{ t.function | tojson(indent=2) }}\n"
    "{{ t.function.parameters | tojson(ensure_ascii=True, separators=(',', ':'), sort_keys=True) }}{% endfor %}"
    "</tools>{% endif %}"
    "{% for m in messages %}{% if m.role == 'system' %}{{ m.content | tojson }}{% continue %}{% endif %}"
    "<|{{ m.role }}|>{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
    "{% else %}{{ m.content }}{% endif %}\n{% if loop.index0 > 5 %}{% break %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_renders_as_transformers_does():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")))
    want = tokenizer.apply_chat_template(MESSAGES, tools=TOOLS, chat_template=TEMPLATE, tokenize=False,
                                         add_generation_prompt=True)
    got = render_chat(MESSAGES, TEMPLATE, tools=TOOLS)
    assert got == want
    assert "Find 'x' in <docs> & notes, naïvely" in got  # nothing HTML-escaped, non-ASCII kept


def test_tojson_takes_json_dumps_arguments():
    value = {"b": "é<", "a": [1, 2]}
    for template, want in [("{{ v | tojson }}", json.dumps(value, ensure_ascii=False)),
                           ("{{ v | tojson(indent=4) }}", json.dumps(value, ensure_ascii=False, indent=4)),
                           ("{{ v | tojson(ensure_ascii=True, sort_keys=True) }}", json.dumps(value, sort_keys=True))]:
        assert render_chat([], template, template_kwargs={"v": value}) == want


def test_strftime_now_writes_todays_date():
    """Llama 3.1 / 3.2 templates put today's date in the system turn when strftime_now is defined."""
    template = ("{% if strftime_now is defined %}{{ strftime_now('%d %b %Y') }}{% else %}26 Jul 2024{% endif %}")
    before = datetime.now()
    got = render_chat([], template)
    assert got in {before.strftime("%d %b %Y"), (before + timedelta(days=1)).strftime("%d %b %Y")}


def test_a_templates_own_check_is_a_request_error():
    with pytest.raises(InvalidRequestError, match="roles must alternate"):
        render_chat(MESSAGES, "{{ raise_exception('roles must alternate') }}")


def test_requests_with_tools_take_the_tool_use_template_as_transformers_does(demo, tmp_path):
    """A tokenizer with named templates (Hermes 2 Pro's "default" and "tool_use"): a request with tools renders
    with "tool_use", one without with "default", as transformers' apply_chat_template picks them."""
    import shutil

    from transformers import AutoTokenizer

    from replicas.chat_template import chat_prompt_ids
    from replicas.tokenizer import Tokenizer

    config = json.loads((demo.model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "{% for m in messages %}{{ m.content }}{% endfor %}"},
                               {"name": "tool_use", "template": "{{ tools | length }} tools: "
                                                                "{% for m in messages %}{{ m.content }}{% endfor %}"}]
    shutil.copy(demo.model_dir / "tokenizer.json", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, hf = Tokenizer.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    chat = [{"role": "user", "content": "hello"}]
    for tools in (None, TOOLS):
        want = hf.apply_chat_template(chat, tools=tools, tokenize=False)
        assert chat_prompt_ids(ours, chat, tools=tools) == ours.encode(want, add_special_tokens=False)
        assert want == ("1 tools: hello" if tools else "hello")
