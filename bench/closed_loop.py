"""A closed loop of requests through one LLMEngine, timed per request and per step (for the engine benches).

Requests join as others finish, `concurrency` at a time. Besides tok/s and the time per output token, it
times chosen engine calls on the host (each call's mean per step) and every step() call; the median step()
of the steps that decoded a full batch with no prompt tokens is the fairest per-step figure: with async
scheduling step() then lasts one period of the GPU's step, and it leaves out how often prompts join.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from replicas.engine import LLMEngine
from replicas.sampling_params import SamplingParams


def _timed(obj: Any, name: str, into: list[float]) -> Callable:
    """Wrap obj.name so that each call's host seconds go to `into`; the original is returned."""
    real = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        out = real(*args, **kwargs)
        into.append(time.perf_counter() - t)
        return out

    setattr(obj, name, wrapper)
    return real


def run_closed_loop(engine: LLMEngine, make: Callable[[int], tuple[list[int], SamplingParams]], count: int,
                    concurrency: int, timed: dict[str, tuple[Any, str]] | None = None) -> dict:
    """make(i) -> (prompt ids, params) of request i. timed: column name -> (object, method) to time."""
    host: dict[str, list[float]] = {key: [] for key in (timed or {})}
    host["step"] = []
    full: list[bool] = []  # per step: a whole batch of decode rows, no prompt tokens
    schedule = engine.scheduler.schedule

    def scheduling():
        out = schedule()
        full.append(len(out.scheduled) == concurrency and not any(s.is_prefill for s in out.scheduled))
        return out

    saved = [(obj, name, _timed(obj, name, host[key])) for key, (obj, name) in (timed or {}).items()]
    saved.append((engine, "step", _timed(engine, "step", host["step"])))
    engine.scheduler.schedule = scheduling
    saved.append((engine.scheduler, "schedule", schedule))
    first, last, counts = {}, {}, {}
    started = 0
    try:
        t0 = time.perf_counter()
        while started < count or engine.has_unfinished_requests():
            while started < count and started - len(last) < concurrency:
                prompt, params = make(started)
                engine.add_request(f"r{started}", {"prompt_token_ids": prompt}, params)
                started += 1
            for out in engine.step():
                now = time.perf_counter() - t0
                n = len(out.outputs[0].token_ids)
                if n:
                    first.setdefault(out.request_id, now)
                counts[out.request_id] = n
                if out.finished:
                    last[out.request_id] = now
        wall = time.perf_counter() - t0
    finally:
        for obj, name, real in saved:
            setattr(obj, name, real)
    tpot = [(last[r] - first[r]) / (counts[r] - 1) for r in last if counts[r] > 1]
    decode = [t for t, f in zip(host["step"], full) if f]
    row = dict(tokens=sum(counts.values()), wall=wall, tok_s=sum(counts.values()) / wall,
               tpot_ms=statistics.median(tpot) * 1e3, steps=len(host["step"]),
               decode_ms=statistics.median(decode) * 1e3 if decode else 0.0, decode_steps=len(decode))
    row.update({f"{key}_ms": statistics.mean(v) * 1e3 if v else 0.0 for key, v in host.items()})
    return row
