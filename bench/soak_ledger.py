"""The soak's client-side bookkeeping (bench/soak.py): what the client believes is registered, what each
request's answer should have been, and the verdicts. Plain Python, no Ray, no HTTP.

Expectations follow the client's own ordering: a request's expected status is fixed when it is SENT. A name
registered (by a load whose 200 came back) and not being loaded or unloaded anywhere between the request's
send and its answer must answer 200; a name unloaded (the unload's 200 came back) or never registered must
answer 404 under the same condition. A load or unload of the name that overlaps the request makes either
answer right. A re-point, refused or not, never does: the name serves throughout. A re-point's target may
answer from the moment the re-point goes out (the server may switch before its 200 reaches the client), so a
request that overlaps a re-point may get the old source or the new one.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

OUTCOMES = ("completed", "refused", "failed_unstarted", "failed_started", "unexpected")


@dataclass
class Name:
    uri: str | None = None  # the source the client believes the name serves (None: not registered)
    flips: int = 0  # loads of an unregistered name and unloads started so far
    flipping: int = 0  # ... of which still waiting for their answer
    repoints: int = 0  # re-points (refused or not) started so far
    targets: list[str] = field(default_factory=list)  # ... their targets, in the order they went out
    open_repoints: list[int] = field(default_factory=list)  # ... the indices of those still waiting for an answer


@dataclass(frozen=True)
class Sent:
    """What the client knew of a name when it sent a request."""

    name: str
    uri: str | None
    flips: int
    flipping: bool
    repoints: int
    repointing: tuple[str, ...] = ()  # targets of the name's re-points in flight when the request went out


class Book:
    """Names the soak manages (loads, unloads, re-points) besides the fixed ones (base model, demo adapters)."""

    def __init__(self, fixed: dict[str, str | None]) -> None:
        self.fixed = dict(fixed)  # name -> uri (None: the base model)
        self.names: dict[str, Name] = {}

    def uri(self, name: str) -> str | None:
        return self.fixed[name] if name in self.fixed else self.names.get(name, Name()).uri

    def registered(self) -> dict[str, str]:
        """Adapter name -> uri, as the client believes the cluster's registry is (demo adapters included)."""
        managed = {n: s.uri for n, s in self.names.items() if s.uri is not None}
        return {**{n: u for n, u in self.fixed.items() if u is not None}, **managed}

    def begin(self, name: str, kind: str, uri: str | None = None) -> int:
        """An admin call on name goes out (kind: load of an unregistered name, unload, repoint to uri); returns
        the call's token for end()."""
        state = self.names.setdefault(name, Name())
        if kind == "repoint":
            state.repoints += 1
            state.targets.append(uri)
            state.open_repoints.append(len(state.targets) - 1)
            return len(state.targets) - 1
        else:
            state.flips += 1
            state.flipping += 1
            return -1

    def end(self, name: str, kind: str, uri: str | None, ok: bool, token: int = -1) -> None:
        """Its answer came back: ok (200) sets the name's source to uri (None: unloaded); a refusal keeps it."""
        state = self.names[name]
        if kind == "repoint":
            state.open_repoints.remove(token)
        else:
            state.flipping -= 1
        if ok:
            state.uri = uri

    def sent(self, name: str) -> Sent:
        state = self.names.get(name, Name())
        return Sent(name, self.uri(name), state.flips, state.flipping > 0, state.repoints,
                    tuple(state.targets[i] for i in state.open_repoints))

    def expected(self, sent: Sent) -> int | None:
        """The status the request must get (200 or 404), or None where a load or unload overlapped it."""
        if sent.name in self.fixed:
            return 200
        now = self.names.get(sent.name, Name())
        if sent.flipping or now.flips != sent.flips:
            return None
        return 200 if sent.uri is not None else 404

    def sources_during(self, sent: Sent) -> set[str] | None:
        """Sources the answer may come from, None where unknown: the one believed when the request went out, the
        one believed at its answer (the same unless a re-point overlapped it), and the targets of re-points that
        overlapped it (in flight when it went out, or sent before its answer), refused ones included: the client
        could not know them refused while they were in flight."""
        now = self.uri(sent.name)
        if self.expected(sent) != 200 or now is None:
            return None
        state = self.names.get(sent.name)
        if state is None:
            return {sent.uri}
        return {sent.uri, now, *sent.repointing, *state.targets[sent.repoints:]}


def error_shape_ok(body: Any, status: int | None = None) -> bool:
    """The OpenAI error body: {"object": "error", "error": {"message", "type", "param", "code"}}."""
    if not isinstance(body, dict) or body.get("object") != "error" or not isinstance(body.get("error"), dict):
        return False
    err = body["error"]
    return (isinstance(err.get("message"), str) and isinstance(err.get("type"), str) and "param" in err
            and isinstance(err.get("code"), int) and (status is None or err["code"] == status))


@dataclass
class Tally:
    """Requests by outcome and by shape (endpoint, streamed); the unexpected ones kept for the report."""

    counts: Counter = field(default_factory=Counter)
    by_shape: Counter = field(default_factory=Counter)
    examples: list[dict] = field(default_factory=list)
    max_examples: int = 50

    def add(self, outcome: str, shape: str, detail: dict | None = None) -> None:
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r}")
        self.counts[outcome] += 1
        self.counts["sent"] += 1
        self.by_shape[f"{shape}:{outcome}"] += 1
        if outcome in ("unexpected", "failed_unstarted") and len(self.examples) < self.max_examples:
            self.examples.append({"outcome": outcome, "shape": shape, **(detail or {})})

    @property
    def failed(self) -> int:
        return self.counts["failed_unstarted"] + self.counts["failed_started"]


# ---- memory ------------------------------------------------------------------------------------------------

@dataclass
class MemoryVerdict:
    replica: str
    actor_id: str
    first_s: float  # the incarnation's first sample, seconds into the run
    last_s: float
    samples: int  # after warm-up
    window_min: float
    start_mb: float
    end_mb: float
    growth_mb: float
    slope_mb_min: float  # Theil-Sen over the samples after warm-up
    allowed_mb: float
    judged: bool  # the window after warm-up was long enough to judge
    flat: bool


def theil_sen(points: list[tuple[float, float]]) -> float:
    """The median of the pairwise slopes: one step of the allocator moves it less than a least-squares fit."""
    slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points) for x2, y2 in points[i + 1:] if x2 > x1]
    return statistics.median(slopes) if slopes else 0.0


def memory_verdicts(samples: list[tuple[float, str, str, float]], warm_from_s: float, warmup_s: float,
                    min_window_s: float, noise_mb: float, slope_mb_min: float) -> list[MemoryVerdict]:
    """samples: (seconds into the run, replica id, actor id, RSS MB). Per incarnation (actor id), the samples
    from max(warm_from_s, its first sample + warmup_s) on: growth (median of the last 3 - median of the first 3)
    must stay within noise_mb + slope_mb_min x the window in minutes."""
    by_actor: dict[str, list[tuple[float, str, float]]] = {}
    for t, replica, actor, mb in samples:
        by_actor.setdefault(actor, []).append((t, replica, mb))
    verdicts = []
    for actor, rows in by_actor.items():
        rows.sort()
        warm = max(warm_from_s, rows[0][0] + warmup_s)
        after = [(t, mb) for t, _, mb in rows if t >= warm]
        window_s = after[-1][0] - after[0][0] if len(after) >= 2 else 0.0
        judged = len(after) >= 6 and window_s >= min_window_s
        start = statistics.median(mb for _, mb in after[:3]) if after else rows[-1][2]
        end = statistics.median(mb for _, mb in after[-3:]) if after else rows[-1][2]
        allowed = noise_mb + slope_mb_min * window_s / 60
        verdicts.append(MemoryVerdict(
            replica=rows[0][1], actor_id=actor, first_s=rows[0][0], last_s=rows[-1][0], samples=len(after),
            window_min=window_s / 60, start_mb=start, end_mb=end, growth_mb=end - start,
            slope_mb_min=theil_sen([(t / 60, mb) for t, mb in after]), allowed_mb=allowed, judged=judged,
            flat=not judged or end - start <= allowed))
    return sorted(verdicts, key=lambda v: v.first_s)


# ---- the report --------------------------------------------------------------------------------------------

def table(result: dict) -> str:
    """The end-of-run table (result: what bench/soak.py gathered)."""
    c, a = result["requests"], result["admin"]
    lines = [f"soak: {result['duration_s']:.0f} s, {result['replicas']} replicas, concurrency "
             f"{result['concurrency']}, a kill every {result['kill_every_s']:.0f} s, seed {result['seed']}",
             "",
             f"{'requests':<12}{'sent':>7}{'completed':>10}{'404 ok':>8}{'failed':>8}{'unstarted':>10}"
             f"{'started':>9}{'unexpected':>11}"]
    shapes = sorted({k.split(':')[0] for k in result["by_shape"]})
    for shape, row in [("all", c)] + [(s, {o: result["by_shape"].get(f"{s}:{o}", 0) for o in OUTCOMES})
                                      for s in shapes]:
        sent = sum(row.get(o, 0) for o in OUTCOMES)
        lines.append(f"{shape:<12}{sent:>7}{row.get('completed', 0):>10}{row.get('refused', 0):>8}"
                     f"{row.get('failed_unstarted', 0) + row.get('failed_started', 0):>8}"
                     f"{row.get('failed_unstarted', 0):>10}{row.get('failed_started', 0):>9}"
                     f"{row.get('unexpected', 0):>11}")
    lines += ["",
              f"admin: loads {a['load_ok']} ok / {a['load_refused']} refused, unloads {a['unload_ok']}, "
              f"re-points {a['repoint_ok']} ok / {a['repoint_refused']} refused, unexpected answers "
              f"{a['unexpected']}; weight probes {result['probes']['checked']} checked / "
              f"{result['probes']['wrong']} wrong (control, on the demo adapters: {result['probes']['control']} / "
              f"{result['probes']['control_wrong']})",
              f"kills {result['kills']} (replicas replaced {result['replaced']}), requests retried after a "
              f"replica loss (server) {result['retried_after_loss']}",
              "",
              f"memory (RSS of each replica incarnation, after warm-up; flat: growth <= "
              f"{result['memory_rule']['noise_mb']:.0f} MB + {result['memory_rule']['slope_mb_min']:.1f} "
              f"MB/min x window)",
              f"{'replica':<10}{'actor':<10}{'alive s':>12}{'window min':>11}{'start MB':>10}{'end MB':>9}"
              f"{'growth MB':>10}{'MB/min':>8}{'allowed':>9}  verdict"]
    for v in result["memory"]:
        verdict = ("flat" if v["flat"] else "GROWING") if v["judged"] else "too short"
        lines.append(f"{v['replica'][:9]:<10}{v['actor_id'][:8]:<10}{v['first_s']:>5.0f}-{v['last_s']:<6.0f}"
                     f"{v['window_min']:>11.1f}{v['start_mb']:>10.0f}{v['end_mb']:>9.0f}{v['growth_mb']:>10.1f}"
                     f"{v['slope_mb_min']:>8.2f}{v['allowed_mb']:>9.1f}  {verdict}")
    lines += ["", "consistency at the end:"] + [f"  {k}: {'ok' if ok else 'BROKEN ' + why}"
                                                 for k, (ok, why) in result["consistency"].items()]
    lines += ["", "hard checks:"] + [f"  {name}: {'PASS' if ok else 'FAIL'}" for name, ok in result["checks"].items()]
    return "\n".join(lines)


def to_json(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=lambda o: dataclasses.asdict(o) if dataclasses.is_dataclass(o)
                      else sorted(o) if isinstance(o, set) else str(o))
