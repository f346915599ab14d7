"""A bounded soak of the demo Serve app (CPU): mixed traffic, adapter loads, unloads and re-points, and a replica
killed every few minutes; at the end, what failed, whether replica memory stayed flat, and whether the registry
is consistent everywhere. Exits 1 when a hard check fails.

    python bench/soak.py                                   # 30 minutes, a kill every 4 minutes
    python bench/soak.py --duration-s 110 --kill-every-s 40 --out /tmp/soak   # CI's short form (~3 min)

It starts its own local Ray (--num-cpus) and the app of deploy/config.yaml with --replicas fixed replicas
(bench/soak_cluster.py), then runs for --duration-s:
  traffic -- --concurrency closed-loop clients: completions and chat, streamed and not, on the base model, the
             demo adapters, the names the soak registered, names it unloaded and names never registered
             (bench/soak_client.py); a fifth of the plain completions are greedy probes whose text must be
             the text of the adapter the name's source copies;
  admin   -- every --admin-every-s one of: load a new name, load an unloaded name again, unload, re-point to
             another adapter, re-point or load to a broken adapter (rank above max_lora_rank, a NaN weight),
             which must be refused (400) and change nothing;
  kills   -- every --kill-every-s, once all replicas run, the busiest replica is killed (ray.kill; Serve
             replaces it);
  memory  -- every --sample-every-s, the RSS of each replica actor's process (and its children).
Hard checks (bench/soak_ledger.py has the client's rules):
  unstarted failures == 0 -- a request that had produced nothing must not fail (the ingress runs it again);
             a stream cut after its first content is "started" and allowed;
  unexpected == 0         -- a 404 for a name the client had registered, a 200 for a name it had unloaded (for
             requests sent after the unload's 200), any other status or malformed body, a short answer, a
             probe answered with other weights; admin calls answered otherwise than planned;
  consistency             -- /v1/models lists exactly the names the client believes registered (with their
             sources), every replica's routing-stats adapters are among them, and registry_dir/adapters.json
             holds the same mapping;
  memory flat             -- per replica incarnation (actor id), RSS growth after warm-up (--warmup-s) <=
             --mem-noise-mb + --mem-slope-mb-min x the window (incarnations watched for less than
             --min-window-s are shown, not judged).
Prints a table; with --out, writes soak.json (the result, the first unexpected requests) and soak_memory.csv.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import httpx  # noqa: E402

from bench import soak_cluster as sc  # noqa: E402
from bench.soak_client import (ADMIN_TIMEOUT_S, REQUEST_TIMEOUT_S, Probes, admin_call, one_request,  # noqa: E402
                               pick_model, probe_text)
from bench.soak_ledger import Book, Tally, memory_verdicts, table, to_json  # noqa: E402

BASE = "lorafleet-demo"
STARTUP_LIMIT_S = 240.0  # Ray, the app and its replicas up, in the whole-run bound
GRACE_S = 120.0  # the traffic's end (running requests finish) and the checks, in the whole-run bound
SETTLE_S = 30.0  # at the end: the replicas back to full strength, unloaded adapters dropped
# Admin actions in turn (one skipped where it cannot apply), so that any run of 7 calls or more makes each.
ADMIN_ROTATION = ("load", "repoint", "refuse_repoint", "load", "unload", "refuse_load", "reload")
MAX_NAMES = 6  # names the soak keeps registered at most, besides the demo adapters


class Soak:
    def __init__(self, args: argparse.Namespace, base: str, book: Book, sources: dict[str, str],
                 broken: dict[str, str], probes: Probes) -> None:
        self.args, self.base, self.book, self.sources, self.broken = args, base, book, sources, broken
        self.probes, self.tally = probes, Tally()
        self.rng = random.Random(args.seed)
        self.start = time.monotonic()
        self.stop = asyncio.Event()
        self.unregistered: list[str] = []
        self.admin = dict(load_ok=0, load_refused=0, unload_ok=0, repoint_ok=0, repoint_refused=0, unexpected=0)
        self.admin_problems: list[str] = []
        self.admin_log: list[tuple] = []  # (began s, answered s, action, name, path, answered as planned)
        self.kills: list[tuple[float, str]] = []
        self.samples: list[tuple[float, str, str, float]] = []
        self.new_names = 0
        self.admin_calls = 0

    def now(self) -> float:
        return time.monotonic() - self.start

    async def _sleep(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self.stop.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    async def traffic(self, client: httpx.AsyncClient, worker: int) -> None:
        rng = random.Random(f"{self.args.seed}-{worker}")
        demo = sorted(n for n, u in self.book.fixed.items() if u is not None)
        while not self.stop.is_set():
            model = pick_model(rng, self.book, self.unregistered, demo, BASE)
            await one_request(client, rng, self.book, self.tally, model, self.probes)

    async def admin_loop(self, client: httpx.AsyncClient) -> None:
        while not self.stop.is_set():
            await self._sleep(self.args.admin_every_s)
            if not self.stop.is_set():
                await self.admin_once(client)

    async def admin_once(self, client: httpx.AsyncClient) -> None:
        rng, managed = self.rng, sorted(n for n, s in self.book.names.items() if s.uri is not None)
        possible = {"load": len(managed) < MAX_NAMES, "reload": bool(self.unregistered) and len(managed) < MAX_NAMES,
                    "unload": len(managed) >= 2, "repoint": bool(managed), "refuse_repoint": bool(managed),
                    "refuse_load": True}
        while not possible[action := ADMIN_ROTATION[self.admin_calls % len(ADMIN_ROTATION)]]:
            self.admin_calls += 1
        self.admin_calls += 1
        if action in ("load", "refuse_load"):
            self.new_names += 1
            name = f"soak-{self.new_names}"
        else:
            name = rng.choice(self.unregistered if action == "reload" else managed)
        kind = {"unload": "unload", "repoint": "repoint", "refuse_repoint": "repoint"}.get(action, "load")
        if action == "unload":
            path = None
        elif action.startswith("refuse"):
            path = self.broken[rng.choice(sorted(self.broken))]
        else:
            path = rng.choice([p for p in sorted(self.sources.values()) if p != self.book.uri(name)])
        want, began = 400 if action.startswith("refuse") else 200, self.now()
        ok, why = await admin_call(client, self.book, kind, name, path, want)
        self.admin_log.append((round(began, 2), round(self.now(), 2), action, name, path, ok))
        if not ok:
            self.admin["unexpected"] += 1
            self.admin_problems.append(f"{self.now():.0f}s {why}")
            await self._resync(client, name)
        else:
            self.admin[{"load": "load_ok", "reload": "load_ok", "unload": "unload_ok", "repoint": "repoint_ok",
                        "refuse_load": "load_refused", "refuse_repoint": "repoint_refused"}[action]] += 1
        registered = self.book.uri(name) is not None
        if registered and name in self.unregistered:
            self.unregistered.remove(name)
        elif not registered and name not in self.unregistered:
            self.unregistered.append(name)  # unloaded, or refused its first load: a 404 from now on

    async def _resync(self, client: httpx.AsyncClient, name: str) -> None:
        """After an admin answer the client did not plan for: take the name's source from /v1/models."""
        try:
            r = await client.get("/v1/models", timeout=30)
            roots = {m["id"]: m["root"] for m in r.json()["data"]}
            state = self.book.names[name]
            state.uri = roots.get(name)
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            self.admin_problems.append(f"resync of {name} failed: {exc!r}")

    async def kill_loop(self) -> None:
        n = self.args.replicas
        for k in range(1, 1 + int(self.args.duration_s // self.args.kill_every_s)):
            await self._sleep(max(0.0, k * self.args.kill_every_s - self.now()))
            while not self.stop.is_set() and not await asyncio.to_thread(
                    lambda: sc.running_replicas() == n and len(sc.replica_actors()) == n):
                await self._sleep(1.0)  # not while a killed replica is still being replaced
            if self.stop.is_set() or self.now() > self.args.duration_s - 10:
                return
            victim = await asyncio.to_thread(sc.kill_busiest)
            if victim is not None:
                self.kills.append((self.now(), victim))
                print(f"  {self.now():6.0f} s  killed replica {victim}", flush=True)

    async def sample_loop(self) -> None:
        while not self.stop.is_set():
            await asyncio.to_thread(self.sample)
            await self._sleep(self.args.sample_every_s)

    def sample(self) -> None:
        for rid, actor in sc.replica_actors().items():
            mb = sc.rss_mb(actor)
            if mb is not None:
                self.samples.append((self.now(), rid, actor._actor_id.hex(), mb))

    async def progress(self) -> None:
        while not self.stop.is_set():
            await self._sleep(30)
            c = self.tally.counts
            print(f"  {self.now():6.0f} s  sent {c['sent']}, completed {c['completed']}, failed "
                  f"{self.tally.failed} (unstarted {c['failed_unstarted']}), unexpected {c['unexpected']}, "
                  f"admin {sum(self.admin.values())}", flush=True)

    async def run(self) -> None:
        limits = httpx.Limits(max_connections=self.args.concurrency + 4)
        async with httpx.AsyncClient(base_url=self.base, limits=limits) as client:
            tasks = [asyncio.create_task(self.traffic(client, i)) for i in range(self.args.concurrency)]
            tasks += [asyncio.create_task(c) for c in (self.admin_loop(client), self.kill_loop(),
                                                       self.sample_loop(), self.progress())]
            await self._sleep(self.args.duration_s)
            self.stop.set()
            await asyncio.wait_for(asyncio.gather(*tasks), max(REQUEST_TIMEOUT_S, ADMIN_TIMEOUT_S) + 15)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration-s", type=float, default=1800.0)
    p.add_argument("--kill-every-s", type=float, default=240.0)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--admin-every-s", type=float, default=5.0)
    p.add_argument("--sample-every-s", type=float, default=10.0)
    p.add_argument("--warmup-s", type=float, default=60.0, help="memory: samples before this are not judged")
    p.add_argument("--min-window-s", type=float, default=60.0, help="memory: shortest window judged")
    p.add_argument("--mem-noise-mb", type=float, default=24.0)
    p.add_argument("--mem-slope-mb-min", type=float, default=1.0)
    p.add_argument("--num-cpus", type=int, default=2)
    p.add_argument("--replica-cpus", type=float, default=0.25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    p.add_argument("--bound-s", type=float, help="the whole run's wall-clock bound (default: start-up, duration, "
                   f"checks: {STARTUP_LIMIT_S:.0f} + duration + {GRACE_S + SETTLE_S:.0f} s); past it: exit 3")
    return p.parse_args(argv)


def watchdog(limit_s: float) -> None:
    """The whole run's bound: past it, say so, stop Ray (its processes would outlive this one) and leave."""
    def expire() -> None:
        print(f"soak: over its bound of {limit_s:.0f} s; exiting", file=sys.stderr, flush=True)
        stopper = threading.Thread(target=sc.stop, daemon=True)
        stopper.start()
        stopper.join(30)
        os._exit(3)

    timer = threading.Timer(limit_s, expire)
    timer.daemon = True
    timer.start()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    watchdog(args.bound_s or STARTUP_LIMIT_S + args.duration_s + GRACE_S + SETTLE_S)
    work = Path(tempfile.mkdtemp(prefix="lorafleet-soak-"))
    registry_dir = work / "registry"
    try:
        t0 = time.monotonic()
        demo = sc.demo_adapters()
        (work / "adapters").mkdir()
        sources, broken = sc.make_sources(work / "adapters", demo)
        base = sc.start(sc.app_args(work / "adapters", registry_dir, args.replicas, args.replica_cpus), args.num_cpus)
        models = {m["id"]: m["root"] for m in httpx.get(f"{base}/v1/models", timeout=60).json()["data"]}
        book = Book({BASE: None, **{n: u for n, u in models.items() if n != BASE}})
        reference = asyncio.run(_references(base, models, sources))
        print(f"soak: up in {time.monotonic() - t0:.0f} s ({args.replicas} replicas, {base}); running "
              f"{args.duration_s:.0f} s", flush=True)
        soak = Soak(args, base, book, sources, broken, Probes(reference))
        asyncio.run(soak.run())
        result = report(soak, registry_dir)
    finally:
        sc.stop()
        shutil.rmtree(work, ignore_errors=True)
    print()
    print(table(result))
    if args.out is not None:
        write(args.out, result, soak.samples)
    return 0 if all(result["checks"].values()) else 1


async def _references(base: str, models: dict[str, str], sources: dict[str, str]) -> dict[str, str]:
    """Each demo adapter's probe text, keyed by its own source and by the soak's copy of it."""
    async with httpx.AsyncClient(base_url=base) as client:
        reference = {}
        for name, copy in sources.items():
            text = await probe_text(client, name)
            reference[models[name]] = reference[copy] = text
        return reference


def report(soak: Soak, registry_dir: Path) -> dict:
    args = soak.args
    checks_consistency = sc.consistency(soak.base, BASE, soak.book.registered(), registry_dir, SETTLE_S)
    memory = memory_verdicts(soak.samples, args.warmup_s, args.warmup_s, args.min_window_s, args.mem_noise_mb,
                             args.mem_slope_mb_min)
    c = soak.tally.counts
    result = {
        "duration_s": args.duration_s, "replicas": args.replicas, "concurrency": args.concurrency,
        "kill_every_s": args.kill_every_s, "seed": args.seed,
        "requests": {k: c[k] for k in ("sent", "completed", "refused", "failed_unstarted", "failed_started",
                                       "unexpected")},
        "by_shape": dict(soak.tally.by_shape), "admin": soak.admin, "admin_problems": soak.admin_problems,
        "probes": {"checked": soak.probes.checked, "wrong": soak.probes.wrong, "control": soak.probes.control,
                   "control_wrong": soak.probes.control_wrong, "reference": soak.probes.reference},
        "kills": len(soak.kills), "kill_log": soak.kills,
        "replaced": len({a for _, _, a, _ in soak.samples}) - args.replicas,
        "retried_after_loss": sc.retried_after_loss(soak.base),
        "memory_rule": {"noise_mb": args.mem_noise_mb, "slope_mb_min": args.mem_slope_mb_min,
                        "warmup_s": args.warmup_s, "min_window_s": args.min_window_s},
        "memory": [vars(v) for v in memory],
        "consistency": checks_consistency, "registered_at_end": len(soak.book.registered()),
        "admin_log": soak.admin_log,
        "unexpected_examples": [{**e, "sent_at": round(e["sent_at"] - soak.start, 2),
                                 "answered_at": round(e["answered_at"] - soak.start, 2)} for e in soak.tally.examples],
    }
    result["checks"] = {
        "no unstarted request failed": c["failed_unstarted"] == 0,
        "no unexpected answer": c["unexpected"] == 0 and soak.admin["unexpected"] == 0,
        "registry consistent": all(ok for ok, _ in checks_consistency.values()),
        "replica memory flat": all(v.flat for v in memory) and any(v.judged for v in memory),
    }
    for problem in soak.admin_problems + [str(e) for e in result["unexpected_examples"][:20]]:
        print(f"  ! {problem}")
    return result


def write(out: Path, result: dict, samples: list) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(to_json(result))
    with open(out / "soak_memory.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["t_s", "replica", "actor_id", "rss_mb"])
        w.writerows((f"{t:.1f}", r, a, f"{mb:.1f}") for t, r, a, mb in samples)
    print(f"written: {out / 'soak.json'}, {out / 'soak_memory.csv'}")


if __name__ == "__main__":
    sys.exit(main())
