"""Tokenizer against transformers' on the demo checkpoint; IncrementalDetokenizer against full decodes."""

from __future__ import annotations

import json
import random
import shutil

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from replicas.demo_checkpoint import CORPUS
from replicas.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError

TEXTS = ["Hello world", "The café served crème brûlée.", "SELECT * FROM users WHERE id = 42;",
         "Rust 🦀 and 日本語 and Ünïcödé", "  leading and trailing spaces  ", "line one\nline two\n\ttab", ""]


@pytest.fixture(scope="module")
def tok(demo):
    return Tokenizer.from_pretrained(demo.model_dir)


@pytest.fixture(scope="module")
def sentencepiece_tok():
    """A SentencePiece-style (Metaspace) tokenizer: a token's leading space depends on its position."""
    raw = HFTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Sequence([decoders.Metaspace(), decoders.ByteFallback(), decoders.Fuse()])
    alphabet = [f"<0x{b:02X}>" for b in range(256)]
    raw.train_from_iterator(CORPUS.splitlines(), trainers.BpeTrainer(
        vocab_size=800, special_tokens=["<unk>", "<s>", "</s>", *alphabet], show_progress=False))
    return Tokenizer(raw, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True})


def stream(tok, ids, chunks=1, **kwargs):
    """(concatenated deltas, list of deltas, detokenizer) for ids fed `chunks` at a time, then finish()."""
    detok = IncrementalDetokenizer(tok, **kwargs)
    deltas = [detok.add_tokens(ids[i:i + chunks]) for i in range(0, len(ids), chunks)] + [detok.finish()]
    return "".join(d.text for d in deltas), deltas, detok


# ---- Tokenizer ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == "<s>" + text


def test_special_tokens_and_template(tok, demo):
    config = json.loads((demo.model_dir / "config.json").read_text())
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<pad>")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == \
        (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"])
    assert tok.vocab_size == len(tok) == config["vocab_size"]
    assert tok.all_special_ids == [0, 1, 2, 3]
    assert "[INST]" in tok.chat_template and tok.model_max_length == 2048


def test_matches_transformers(tok, demo):
    import transformers
    hf = transformers.AutoTokenizer.from_pretrained(demo.model_dir)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == \
        (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    for text in TEXTS + [CORPUS[:2000]]:
        for special in (True, False):
            ids = hf(text, add_special_tokens=special)["input_ids"]
            assert tok.encode(text, add_special_tokens=special) == ids
            for skip in (True, False):
                assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert hf.chat_template == tok.chat_template
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    rendered = hf.apply_chat_template(chat, tokenize=False)
    assert rendered == "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello </s><s>[INST] Bye [/INST]"
    assert tok.encode(rendered, add_special_tokens=False)[0] == tok.bos_token_id  # the template adds bos


def test_config_variants(demo, tmp_path):
    shutil.copy(demo.model_dir / "tokenizer.json", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>", "add_bos_token": False,
        "add_eos_token": True, "chat_template": [{"name": "tool_use", "template": "T"},
                                                 {"name": "default", "template": "D"}]}))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.bos_token_id == 1 and (tok.chat_template, tok.tool_use_template) == ("D", "T")
    assert tok.encode("Hello") == tok.encode("Hello", add_special_tokens=False) + [tok.eos_token_id]
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "chat_template.jinja").write_text("J")
    tok = Tokenizer.from_pretrained(tmp_path)
    assert (tok.chat_template, tok.tool_use_template) == ("J", None) and tok.bos_token_id is None
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("TJ")
    assert Tokenizer.from_pretrained(tmp_path).tool_use_template == "TJ"
    assert tok.encode("Hello")[0] == 1  # tokenizer.json's own post-processor still applies


def test_missing_or_bad_files(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot be loaded"):
        Tokenizer.from_pretrained(tmp_path)


# ---- IncrementalDetokenizer --------------------------------------------------------------------------


def random_ids(tok, rng, n, byte_level):
    """n random pieces. SentencePiece's ByteFallback decodes a run of byte tokens that is not valid UTF-8
    as one U+FFFD per token, valid or not, so a split run decodes differently; its byte runs are kept
    to whole characters (what a real model emits) by drawing them from the encoding of random characters."""
    if byte_level:
        return [rng.randrange(tok.vocab_size) for _ in range(n)]
    ids = []
    for _ in range(n):
        if rng.random() < 0.2:
            ids += tok.encode(chr(rng.choice([rng.randrange(0x80, 0x800), rng.randrange(0x4E00, 0x9FFF),
                                              rng.randrange(0x1F300, 0x1FAFF)])), add_special_tokens=False)
        else:
            ids.append(rng.choice([i for i in range(tok.vocab_size) if not (3 <= i < 259)]))
    return ids


@pytest.mark.parametrize("which", ["demo", "sentencepiece"])
def test_incremental_equals_full_decode_on_random_ids(which, tok, sentencepiece_tok):
    tok = tok if which == "demo" else sentencepiece_tok
    rng = random.Random(0)
    for _ in range(500):
        ids = random_ids(tok, rng, rng.randint(0, 30), byte_level=which == "demo")
        skip = rng.random() < 0.7
        text, deltas, detok = stream(tok, ids, chunks=rng.randint(1, 3), skip_special_tokens=skip)
        assert text == tok.decode(ids, skip_special_tokens=skip)
        assert detok.text == text and detok.token_ids == ids and not any(d.stopped for d in deltas)
        if which == "demo":  # byte-level: a prompt ending on a whole character changes nothing
            prompt = tok.encode(rng.choice(TEXTS))
            assert stream(tok, ids, prompt_ids=prompt, skip_special_tokens=skip)[0] == text


def test_prompt_context_gives_sentencepiece_leading_space(sentencepiece_tok):
    tok = sentencepiece_tok
    prompt, full = tok.encode("The quick brown"), tok.encode("The quick brown fox jumps")
    generated = full[len(prompt):]
    assert tok.decode(generated) == "fox jumps"  # decoded alone, the leading space is lost
    assert stream(tok, generated, prompt_ids=prompt)[0] == " fox jumps"


def test_multibyte_character_is_emitted_whole(tok):
    ids = tok.encode("a 🦀 b", add_special_tokens=False)
    assert len(ids) > 3  # the crab is not in the corpus: it arrives as several byte tokens
    text, deltas, _ = stream(tok, ids)
    assert text == "a 🦀 b" and not any("\ufffd" in d.text for d in deltas)
    assert "🦀" in [d.text.strip() for d in deltas]


def test_stop_string_split_across_tokens(tok):
    ids = tok.encode("The quick brown fox jumps over the lazy dog.", add_special_tokens=False)
    stop = "own fox ju"  # starts inside one token, spans two more
    text, deltas, detok = stream(tok, ids, stop=[stop])
    assert text == "The quick br" and detok.text == text
    assert detok.stopped and detok.stop_str == stop
    first = [d.stopped for d in deltas].index(True)
    assert first < len(ids) - 1 and all(d == ("", True) for d in deltas[first + 1:])  # the rest are ignored
    assert [d.text for d in deltas[:3]] == ["The", " quick", " br"]  # "own" might start the stop string
    assert stream(tok, ids, stop=[stop], include_stop_str_in_output=True)[0] == "The quick brown fox ju"
    assert detok.add_tokens(ids) == ("", True)  # later tokens are ignored


def test_earliest_of_several_stops_wins(tok):
    ids = tok.encode("one two three four", add_special_tokens=False)
    assert stream(tok, ids, stop=["four", "two", "xyz"])[0] == "one "
    assert stream(tok, ids, stop=["o t"])[0] == "one tw"
    assert stream(tok, ids, stop=["one"])[0] == ""
    assert stream(tok, ids, stop="three")[0] == "one two "  # one string, not a list of characters


def test_possible_stop_prefix_is_held_back_then_released(tok):
    detok = IncrementalDetokenizer(tok, stop=["STOP here"])
    assert detok.add_tokens(tok.encode("go ST", add_special_tokens=False)).text == "go "
    assert detok.add_tokens(tok.encode("OP", add_special_tokens=False)).text == ""  # "STOP" may go on
    assert detok.add_tokens(tok.encode(" now", add_special_tokens=False)) == ("STOP now", False)
    assert detok.add_tokens(tok.encode(" ST", add_special_tokens=False)).text == " "
    assert detok.finish() == ("ST", False)  # generation ended: nothing can complete the stop string
    assert detok.text == "go STOP now ST"


def test_stop_strings_on_random_ids(tok):
    """Streaming never emits text past the first stop string, wherever the stop string falls."""
    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.randrange(4, tok.vocab_size) for _ in range(rng.randint(1, 25))]
        full = tok.decode(ids)
        i = rng.randrange(len(full))
        stop = full[i:i + rng.randint(1, 8)]
        text, deltas, detok = stream(tok, ids, chunks=rng.randint(1, 2), stop=[stop, "\x00never"])
        assert text == full[:full.find(stop)] and detok.stop_str == stop


def test_no_stop_string_fires_before_min_tokens(tok):
    """A stop string the first min_tokens - 1 ids complete is output; the min_tokens-th id may complete one (as
    in vLLM, which looks from then on), and the next one stops the output."""
    ids = tok.encode("one two one two one", add_special_tokens=False)
    first_two = len(tok.encode("one two", add_special_tokens=False))
    assert stream(tok, ids, stop=["two"])[0] == "one "
    assert stream(tok, ids, stop=["two"], min_tokens=first_two)[0] == "one "
    detok = IncrementalDetokenizer(tok, stop=["two"], min_tokens=first_two + 1)
    text = "".join(detok.add_tokens([i]).text for i in ids) + detok.finish().text
    assert text == "one two one " and detok.stop_str == "two"
