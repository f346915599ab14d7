"""Tokenizer: an HF model directory's tokenizer.json + tokenizer_config.json, through `tokenizers` only.

IncrementalDetokenizer turns a growing list of generated ids into text deltas
for streaming. Decoding token by token is wrong for byte-level BPE (one
character may span several tokens) and for SentencePiece (a token's leading
space depends on its neighbours), so it decodes a short window of recent ids
twice, with and without the new ones, and emits the difference, holding text
back while it ends in an incomplete UTF-8 sequence: the prefix-offset scheme
of vLLM and TGI. Stop strings are matched on the decoded text, and text that
might still become the start of a stop string is held back until it cannot.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import processors

from replicas.errors import EngineError

_REPLACEMENT = "\ufffd"  # what a lossy UTF-8 decode shows for bytes that do not form a character (yet)
_PROMPT_CONTEXT = 5  # prompt ids decoded as left context for the first generated tokens, as in vLLM


class TokenizerError(EngineError, ValueError):
    """The model directory's tokenizer files are missing or unreadable."""


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json spells a special token as "<s>" or as an AddedToken dict {"content": "<s>", ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """Encode / decode for one model, with its special tokens and chat template."""

    def __init__(self, tokenizer: _HFTokenizer, config: dict[str, Any] | None = None,
                 chat_template: str | None = None, tool_use_template: str | None = None) -> None:
        config = config or {}
        self._tok = tokenizer
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self.pad_token = _token_content(config.get("pad_token"))
        self.unk_token = _token_content(config.get("unk_token"))
        self.bos_token_id = self.token_to_id(self.bos_token)
        self.eos_token_id = self.token_to_id(self.eos_token)
        self.pad_token_id = self.token_to_id(self.pad_token)
        self.chat_template = chat_template
        # a second template for requests with tools (Hermes 2 Pro, Command R): transformers picks it then
        self.tool_use_template = tool_use_template
        self.model_max_length = config.get("model_max_length")
        if "add_bos_token" in config or "add_eos_token" in config:
            self._set_bos_eos(bool(config.get("add_bos_token", False)), bool(config.get("add_eos_token", False)))

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "Tokenizer":
        """Load tokenizer.json, tokenizer_config.json and the chat template (if any) from model_dir."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"no tokenizer.json in {model_dir} (only fast-tokenizer files are supported)")
        try:
            tok = _HFTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises a bare Exception
            raise TokenizerError(f"{path}: cannot be loaded ({exc})") from exc
        config = _read_json(model_dir / "tokenizer_config.json")
        return cls(tok, config, *_chat_templates(model_dir, config))

    def _set_bos_eos(self, add_bos: bool, add_eos: bool) -> None:
        """What Llama/Mistral tokenizer configs ask with add_bos_token / add_eos_token (transformers does the same)."""
        specials = [(t, i) for t, i, on in ((self.bos_token, self.bos_token_id, add_bos),
                                             (self.eos_token, self.eos_token_id, add_eos)) if on and i is not None]
        bos = f"{self.bos_token}:0 " if add_bos and self.bos_token_id is not None else ""
        eos = f" {self.eos_token}:0" if add_eos and self.eos_token_id is not None else ""
        pair_bos, pair_eos = bos.replace(":0", ":1"), eos.replace(":0", ":1")
        self._tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}$A:0{eos}", pair=f"{bos}$A:0{eos} {pair_bos}$B:1{pair_eos}", special_tokens=specials)

    @property
    def backend(self) -> _HFTokenizer:
        """The `tokenizers` object itself, for libraries that read the vocabulary (replicas/grammar.py)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return self.vocab_size


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"{path}: cannot be read ({exc})") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return data


def _chat_templates(model_dir: Path, config: dict[str, Any]) -> tuple[str | None, str | None]:
    """(the default chat template, the "tool_use" one or None): tokenizer_config.json's chat_template (a string,
    or a list of named ones), else chat_template.jinja and additional_chat_templates/tool_use.jinja (the files
    transformers >= 4.54 saves them in)."""
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default"), named.get("tool_use")
    if isinstance(template, str):
        return template, None

    def read(path: Path) -> str | None:
        return path.read_text(encoding="utf-8") if path.is_file() else None
    return read(model_dir / "chat_template.jinja"), read(model_dir / "additional_chat_templates" / "tool_use.jinja")


class Delta(NamedTuple):
    """The text a step of decoding makes final, and whether a stop string ended the output."""

    text: str
    stopped: bool


class IncrementalDetokenizer:
    """Streams one request's generated ids as text, cutting the output at the first stop string.

    add_tokens(ids) returns the new text that is final (no later token can
    change it and it cannot be the start of a stop string); finish() returns
    whatever was held back once generation ends for another reason. After a
    stop string fires, the output is cut before it (or after it with
    include_stop_str_in_output) and later tokens are ignored. With min_tokens,
    none fires before that many ids were generated.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), stop: str | Iterable[str] = (),
                 skip_special_tokens: bool = True, include_stop_str_in_output: bool = False,
                 min_tokens: int = 0) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._stops = tuple(s for s in dict.fromkeys([stop] if isinstance(stop, str) else stop) if s)
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens  # no stop string ends the output before this many ids
        context = list(prompt_ids[-_PROMPT_CONTEXT:])
        if tokenizer.decode(context, skip_special_tokens).endswith(_REPLACEMENT):
            context = []  # a prompt ending mid-character would swallow the output's first bytes
        self._ids = context  # context + generated ids
        self._prefix_offset = 0  # window start: decoded for context only
        self._read_offset = len(context)  # ids before this have been turned into text
        self._num_context = len(context)
        self._text = ""  # all text decoded so far; text[:_emitted] has been returned
        self._emitted = 0
        self.stop_str: str | None = None  # the stop string that fired, if any

    @property
    def token_ids(self) -> list[int]:
        """The generated ids seen so far (the prompt context excluded)."""
        return self._ids[self._num_context:]

    @property
    def text(self) -> str:
        """The output text returned so far."""
        return self._text[:self._emitted]

    @property
    def stopped(self) -> bool:
        return self.stop_str is not None

    def add_tokens(self, token_ids: Iterable[int]) -> Delta:
        """Append generated ids; return the text they make final."""
        if self.stopped:
            return Delta("", True)
        self._ids.extend(token_ids)
        self._text += self._decode_new(final=False)
        return self._release(final=False)

    def finish(self) -> Delta:
        """Generation ended (eos, length, abort): return the held-back text, stop strings still applied."""
        if self.stopped:
            return Delta("", True)
        self._text += self._decode_new(final=True)
        return self._release(final=True)

    def _decode_new(self, final: bool) -> str:
        """The text of ids[read_offset:], decoded with ids[prefix_offset:read_offset] as left context."""
        window = self._ids[self._prefix_offset:]
        prefix_text = self._tokenizer.decode(window[:self._read_offset - self._prefix_offset], self._skip)
        new_text = self._tokenizer.decode(window, self._skip)
        # A trailing U+FFFD is a character whose bytes have not all arrived; wait for the rest.
        if len(new_text) <= len(prefix_text) or (new_text.endswith(_REPLACEMENT) and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[len(prefix_text):]

    def _release(self, final: bool) -> Delta:
        """Return the newly final text: up to a stop string, else all but a possible stop-string start."""
        start = self._emitted
        # Short of min_tokens a stop string does not fire, but a possible start of one is still held back, so
        # that one completed by the ids after it is found (vLLM looks for it in the text those ids added).
        live = len(self._ids) - self._num_context >= self._min_tokens
        hits = [(i, s) for s in self._stops if live and (i := self._text.find(s, start)) >= 0]
        if hits:
            i, s = min(hits)
            self.stop_str = s
            self._text = self._text[:i + len(s) if self._include_stop else i]
            self._emitted = len(self._text)
            return Delta(self._text[start:], True)
        end = len(self._text) if final else len(self._text) - self._partial_stop_len()
        self._emitted = max(start, end)
        return Delta(self._text[start:self._emitted], False)

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        text, longest = self._text, 0
        for s in self._stops:
            for n in range(min(len(s) - 1, len(text) - self._emitted), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest
