"""What one streamed chunk of a request's output costs the replica and the ingress, before and after
cluster/output_stream.py (CPU only: it is host time on the event loops).

The replica's deployment sends one chunk per engine step for every streaming request. Before: the
cumulative RequestOutput through dataclasses.asdict (a deep copy), pickled by Ray, unpickled and rebuilt into
dataclasses at the ingress. After: DeltaEncoder's chunk (the tokens, text and logprobs that step added),
pickled, unpickled, DeltaDecoder. Per output length (the chunk at that point of the answer), with and
without logprobs (5 a token), side by side, p50 of --iters:

    python bench/stream_encoding.py --prompt 500 --lengths 10 100 1000 4000

A request's whole stream costs about the sum over its chunks: before, it grew with the square of its length.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import time
from dataclasses import asdict

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from cluster.output_stream import DeltaDecoder, DeltaEncoder  # noqa: E402
from replicas.outputs import CompletionOutput, RequestOutput  # noqa: E402


def output(prompt: int, length: int, logprobs: bool) -> RequestOutput:
    ids = [1000 + i for i in range(length)]
    lps = [{t: -0.5, **{t + j: -1.0 - j for j in range(1, 6)}} for t in ids] if logprobs else None
    return RequestOutput("req", "p" * (4 * prompt), list(range(prompt)),
                         [CompletionOutput(0, "t" * (4 * length), ids, lps)])


def before(out: RequestOutput) -> tuple[float, float]:
    t = time.perf_counter()
    wire = pickle.dumps(asdict(out))
    replica = time.perf_counter() - t
    t = time.perf_counter()
    item = pickle.loads(wire)
    RequestOutput(**{**item, "outputs": [CompletionOutput(**c) for c in item["outputs"]]})
    return replica, time.perf_counter() - t


def after(encoder: DeltaEncoder, decoder: DeltaDecoder, out: RequestOutput) -> tuple[float, float]:
    t = time.perf_counter()
    wire = pickle.dumps(encoder.encode(out))
    replica = time.perf_counter() - t
    t = time.perf_counter()
    decoder.decode(pickle.loads(wire))
    return replica, time.perf_counter() - t


def time_after(prompt: int, length: int, logprobs: bool, iters: int) -> tuple[float, float]:
    """A chunk at `length` tokens, the stream so far sent: the encoder and decoder hold length - 1 tokens."""
    reps, ings = [], []
    for _ in range(iters):
        encoder, decoder = DeltaEncoder(), DeltaDecoder()
        full = output(prompt, length, logprobs)
        head = output(prompt, length - 1, logprobs)
        decoder.decode(encoder.encode(head))
        r, i = after(encoder, decoder, full)
        reps.append(r)
        ings.append(i)
    return statistics.median(reps), statistics.median(ings)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt", type=int, default=500)
    p.add_argument("--lengths", type=int, nargs="+", default=[10, 100, 1000, 4000])
    p.add_argument("--iters", type=int, default=30)
    a = p.parse_args()
    print(f"one chunk's host time (us), prompt {a.prompt} tokens; before = asdict + pickle, after = deltas")
    print(f"{'tokens':>7} {'logprobs':>8} {'replica before':>15} {'after':>8} {'ratio':>7} "
          f"{'ingress before':>15} {'after':>8} {'ratio':>7}")
    for logprobs in (False, True):
        for length in a.lengths:
            out = output(a.prompt, length, logprobs)
            old = [before(out) for _ in range(a.iters)]
            old_r, old_i = statistics.median(o[0] for o in old), statistics.median(o[1] for o in old)
            new_r, new_i = time_after(a.prompt, length, logprobs, a.iters)
            print(f"{length:7d} {str(logprobs):>8} {old_r * 1e6:15.1f} {new_r * 1e6:8.1f} {old_r / new_r:7.1f} "
                  f"{old_i * 1e6:15.1f} {new_i * 1e6:8.1f} {old_i / new_i:7.1f}")


if __name__ == "__main__":
    main()
