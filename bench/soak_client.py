"""The soak's HTTP client (bench/soak.py): one request of the traffic mix, classified, and one admin call.

A request is judged on what it had produced before it failed: for a stream, a content chunk before an in-band
error event or a cut connection ("started": a kill may cut it); anything else that fails had produced nothing
("unstarted": the ingress must have run it again elsewhere, so it is a failure of the system).
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass
from typing import Any

import httpx

from bench.soak_ledger import Book, Tally, error_shape_ok

REQUEST_TIMEOUT_S = 90.0  # one request, whole; a stream's chunks may not pause longer than READ_TIMEOUT_S
READ_TIMEOUT_S = 30.0
ADMIN_TIMEOUT_S = 60.0
PROMPTS = ("The quick brown fox", "Once upon a time there was", "SELECT name FROM", "Translate to French: the sea",
           "Summarize: the baker opened his shop")
PROBE = {"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0}


@dataclass
class Probes:
    """Greedy probes: a name must answer with the text of the adapter its source is a copy of."""

    reference: dict[str, str]  # source uri -> the probe's text
    checked: int = 0
    wrong: int = 0
    control: int = 0  # probes of the demo adapters, whose source never changes: numerics, not registry
    control_wrong: int = 0


def loop_time() -> float:
    return asyncio.get_running_loop().time()


def timeout() -> httpx.Timeout:
    return httpx.Timeout(READ_TIMEOUT_S, connect=10.0)


async def probe_text(client: httpx.AsyncClient, model: str) -> str:
    r = await client.post("/v1/completions", json={"model": model, **PROBE}, timeout=timeout())
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def pick_model(rng: random.Random, book: Book, unloaded: list[str], demo: list[str], base: str) -> str:
    managed = [n for n, s in book.names.items() if s.uri is not None]
    r = rng.random()
    if r < 0.2 or (r >= 0.45 and r < 0.9 and not managed):
        return base
    if r < 0.45:
        return rng.choice(demo)
    if r < 0.9:
        return rng.choice(managed)
    if r < 0.97 and unloaded:
        return rng.choice(unloaded)
    return f"soak-never-{rng.randrange(1000)}"


async def one_request(client: httpx.AsyncClient, rng: random.Random, book: Book, tally: Tally, model: str,
                      probes: Probes) -> None:
    """Send one request of the mix for model, and add its outcome to tally."""
    chat, stream = rng.random() < 0.5, rng.random() < 0.5
    probe = not stream and not chat and rng.random() < 0.2 and book.uri(model) in probes.reference
    max_tokens = PROBE["max_tokens"] if probe else rng.randint(8, 40)
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                            "stream": stream}
    prompt = PROBE["prompt"] if probe else rng.choice(PROMPTS)
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    shape = f"{'chat' if chat else 'cmpl'}/{'stream' if stream else 'plain'}"
    sent, t_sent = book.sent(model), loop_time()
    seen = {"content": False}
    try:
        status, outcome, why, text = await asyncio.wait_for(
            _exchange(client, "/v1/chat/completions" if chat else "/v1/completions", body, stream, max_tokens, seen),
            REQUEST_TIMEOUT_S)
    except (httpx.HTTPError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        status, outcome, why, text = None, "failed_started" if seen["content"] else "failed_unstarted", repr(exc), None
    expected = book.expected(sent)
    if status == 200 and expected == 404:
        outcome, why = "unexpected", "served a name the client had unloaded (or never registered)"
    elif status == 404:
        if expected == 200:
            outcome, why = "unexpected", "404 for a name the client believes registered"
        elif outcome == "refused_shape_ok":
            outcome = "refused"
    if probe and outcome == "completed":
        sources = book.sources_during(sent)
        # A target no probe knows (a broken adapter a re-point must refuse) cannot match: it stays out of the
        # texts, so that an answer with its weights counts as wrong.
        if sources is not None and sent.uri in probes.reference:
            fixed = model in book.fixed
            probes.control += fixed
            probes.checked += not fixed
            if text not in {probes.reference[s] for s in sources if s in probes.reference}:
                probes.control_wrong += fixed
                probes.wrong += not fixed
                if not fixed:
                    matches = sorted(u for u, t in probes.reference.items() if t == text)
                    outcome, why = "unexpected", (f"probe text {text!r} is not that of the source(s) "
                                                  f"{sorted(sources)} but of {matches or 'none'}")
    tally.add(outcome, shape, {"model": model, "status": status, "expected": expected, "why": why,
                                  "sent_at": round(t_sent, 2), "answered_at": round(loop_time(), 2)})


async def _exchange(client: httpx.AsyncClient, path: str, body: dict, stream: bool, max_tokens: int,
                    seen: dict) -> tuple[int, str, str | None, str | None]:
    """(status, outcome, why, text); outcome "refused_shape_ok" is a well-formed 404 the caller judges."""
    if not stream:
        r = await client.post(path, json=body, timeout=timeout())
        if r.status_code != 200:
            return (r.status_code,) + _error(r)
        out = r.json()
        got = out.get("usage", {}).get("completion_tokens")
        if got != max_tokens:
            return 200, "unexpected", f"completion_tokens {got}, asked {max_tokens}", None
        choice = out["choices"][0]
        return 200, "completed", None, choice.get("text", (choice.get("message") or {}).get("content"))
    async with client.stream("POST", path, json=body, timeout=timeout()) as r:
        if r.status_code != 200:
            await r.aread()
            return (r.status_code,) + _error(r)
        error, done, finished, usage = None, False, False, None
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if chunk.get("object") == "error":
                error = chunk
                continue
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                if choice.get("text") or (choice.get("delta") or {}).get("content"):
                    seen["content"] = True
                finished = finished or bool(choice.get("finish_reason"))
    started = "failed_started" if seen["content"] else "failed_unstarted"
    if error is not None:
        if not error_shape_ok(error):
            return 200, "unexpected", f"in-band error not in the OpenAI shape: {error}", None
        return 200, started, f"in-band error {error['error']['code']}: {error['error']['message']}", None
    if not done:
        return 200, started, "the stream ended without [DONE]", None
    if not finished or (usage or {}).get("completion_tokens") != max_tokens:
        return 200, "unexpected", f"stream finished {finished}, usage {usage}, asked {max_tokens}", None
    return 200, "completed", None, None


def _error(r: httpx.Response) -> tuple[str, str | None, None]:
    try:
        body = r.json()
    except ValueError:
        body = r.text[:300]
    if not error_shape_ok(body, r.status_code):
        return "unexpected", f"error body not in the OpenAI shape: {body}", None
    message = body["error"]["message"]
    if r.status_code == 404:
        return "refused_shape_ok", message, None
    if r.status_code >= 500:
        return "failed_unstarted", f"{r.status_code}: {message}", None
    return "unexpected", f"{r.status_code}: {message}", None


async def admin_call(client: httpx.AsyncClient, book: Book, kind: str, name: str, path: str | None,
                     want: int) -> tuple[bool, str | None]:
    """One load / re-point (path) or unload (path None) of name; (answered as wanted, why not). The book records
    the call's window and, on 200, the name's new source."""
    token = book.begin(name, kind, path)
    ok = False
    try:
        if path is None:
            r = await client.post("/v1/unload_lora_adapter", json={"lora_name": name}, timeout=ADMIN_TIMEOUT_S)
        else:
            r = await client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path},
                                  timeout=ADMIN_TIMEOUT_S)
        ok = r.status_code == 200
        if r.status_code == want and (ok or error_shape_ok(r.json(), want)):
            return True, None
        return False, f"{kind} {name} -> {path}: {r.status_code} (wanted {want}): {r.text[:300]}"
    except (httpx.HTTPError, ValueError) as exc:
        return False, f"{kind} {name} -> {path}: {exc!r} (outcome unknown)"
    finally:
        book.end(name, kind, path, ok, token)
