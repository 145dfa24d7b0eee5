"""Micro-benchmark of basert._ext.matmul: GFLOP/s and weight GB/s on SmolLM2-135M shapes, then whole-model passes.

Per shape, M=1 is timed "hot" (one weight, cache-resident: the kernel's own speed) and "cold" (cycling
through copies that overflow the last-level cache, as decode on a real model does). The model rows run
every matmul of SmolLM2-135M once (30 layers of base_q4 g32 asymmetric + the base_q8 g32 symmetric
lm_head, about 97 MB): M=1 is one decode step, M=512 a 512-token prefill; they give matmul-only tokens/s.
Every time is the best of several rounds (see seconds_per_call). GB/s counts the weight bytes only
(packed codes + scales + biases); it is the number that matters for M=1.
Run: python tools/bench_matmul.py [--threads 1 2] [--m 1 128 512] [--skip-shapes] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

import basert._ext
from basert._ext import matmul as mm
from basert.cli.bench import cpu_model

SHAPES = ((576, 576), (1536, 576), (576, 1536), (49152, 576))  # N x K: attention, gate/up, down, lm_head
KINDS = (("base_q4", 32, False), ("base_q8", 32, True), ("f32", 0, False))  # kind, group, symmetric
COLD_BYTES = 96 << 20  # three times a 32 MiB L3
LAYERS = 30
# q k v o gate up down
LAYER_SHAPES = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))
VOCAB = 49152


@dataclass(slots=True)
class Result:
    case: str
    shape: str
    m: str
    threads: int
    us_per_call: float
    gflops: float
    weight_gbps: float


def make_weight(kind: str, group: int, symmetric: bool, n: int, k: int,
                rng: np.random.Generator) -> tuple[mm.Weight, int]:
    """A weight of random codes (timing does not depend on values) and its size in bytes, scales included."""
    if kind == "f32":
        data = rng.standard_normal(n * k, dtype=np.float32).view(np.uint8)
        return mm.Weight("f32", n, k, data), data.nbytes
    packed = rng.integers(0, 256, n * k // (2 if kind == "base_q4" else 1), dtype=np.uint8)
    groups = n * k // group
    scales = (rng.random(groups, dtype=np.float32) * 0.01).astype(np.float16).view(np.uint16)
    biases = None if symmetric else (-rng.random(groups, dtype=np.float32) * 0.1).astype(np.float16).view(np.uint16)
    size = packed.nbytes + scales.nbytes + (0 if biases is None else biases.nbytes)
    return mm.Weight(kind, n, k, packed, scales, biases, group), size


def seconds_per_call(call: Callable[[], None], min_time: float) -> float:
    """Best mean over rounds of at least 5 ms, for min_time seconds and 3 rounds at least: on a shared
    machine a round that another process interrupted is only ever slower, so the best is the kernel's own speed."""
    reps = 1
    while True:
        start = time.perf_counter()
        for _ in range(reps):
            call()
        if time.perf_counter() - start >= 0.005:
            break
        reps *= 2
    best, rounds, deadline = float("inf"), 0, time.perf_counter() + min_time
    while rounds < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        for _ in range(reps):
            call()
        best = min(best, (time.perf_counter() - start) / reps)
        rounds += 1
    return best


def print_row(result: Result) -> None:
    print(f"{result.case:13} {result.shape:>12} M={result.m:7} t={result.threads}  {result.us_per_call:11.1f} us  "
          f"{result.gflops:7.1f} GFLOP/s  {result.weight_gbps:6.2f} GB/s", flush=True)
    if result.case == "smollm2-135m":
        tokens_per_s = int(result.m) / (result.us_per_call * 1e-6)
        phase = "decode" if result.m == "1" else "prefill"
        print(f"{'':13} -> {tokens_per_s:.0f} tokens/s from matmul alone ({phase})",
              flush=True)


def bench_shapes(threads: list[int], ms: list[int], min_time: float, rng: np.random.Generator) -> list[Result]:
    results: list[Result] = []
    for n, k in SHAPES:
        for kind, group, symmetric in KINDS:
            case = kind if not group else f"{kind}-g{group}{'s' if symmetric else 'a'}"
            weight, size = make_weight(kind, group, symmetric, n, k, rng)
            copies = [weight] + [make_weight(kind, group, symmetric, n, k, rng)[0] for _ in range(COLD_BYTES // size)]
            for t in threads:
                mm.set_num_threads(t)
                for m in ms:
                    x = rng.standard_normal((m, k), dtype=np.float32)
                    out = np.empty((m, n), dtype=np.float32)
                    runs = {"hot" if m == 1 else str(m): lambda: mm.matmul(x, weight, out)}
                    if m == 1:
                        runs["cold"] = lambda: [mm.matmul(x, w, out) for w in copies]
                    for label, call in runs.items():
                        calls = len(copies) if label == "cold" else 1
                        s = seconds_per_call(call, min_time) / calls
                        results.append(Result(case, f"{n}x{k}", f"1 {label}" if m == 1 else label, t, s * 1e6,
                                              2 * m * n * k / s / 1e9, size / s / 1e9))
                        print_row(results[-1])
    return results


DECODE_MAX_M = 16  # batches up to this size are decode steps of several slots


def bench_model(threads: list[int], min_time: float, rng: np.random.Generator) -> list[Result]:
    """Every matmul of SmolLM2-135M once, at M=1 (decode), 2, 4 and 8 (batched decode) and 512 (prefill)."""
    layers = [make_weight("base_q4", 32, False, n, k, rng) for _ in range(LAYERS) for n, k in LAYER_SHAPES]
    weights = layers + [make_weight("base_q8", 32, True, VOCAB, 576, rng)]
    size = sum(s for _, s in weights)
    flops_per_token = 2 * sum(w.n * w.k for w, _ in weights)
    lm_head_flops = 2 * VOCAB * 576
    results: list[Result] = []
    for m in (1, 2, 4, 8, 512):
        xs = {k: rng.standard_normal((m, k), dtype=np.float32) for k in (576, 1536)}
        outs = [np.empty((m, w.n), dtype=np.float32) for w, _ in weights]
        # Prefill needs logits for the last position only; batched decode for every row.
        head_rows = m if m <= DECODE_MAX_M else 1
        calls = [(xs[w.k][-head_rows:] if w.n == VOCAB else xs[w.k], w, out[-head_rows:] if w.n == VOCAB else out)
                 for (w, _), out in zip(weights, outs, strict=True)]
        for t in threads:
            mm.set_num_threads(t)
            s = seconds_per_call(lambda: [mm.matmul(x, w, out) for x, w, out in calls], min_time)
            flops = (flops_per_token - lm_head_flops) * m + lm_head_flops * head_rows
            results.append(Result("smollm2-135m", f"{len(weights)} mats", str(m), t, s * 1e6, flops / s / 1e9,
                                  size / s / 1e9))
            print_row(results[-1])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--m", type=int, nargs="+", default=[1, 128, 512])
    parser.add_argument("--min-time", type=float, default=0.5, help="seconds of timing per row")
    parser.add_argument("--skip-shapes", action="store_true", help="only the whole-model passes")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run everything this many times and print the best of each row at the end")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"{cpu_model()} ({basert._ext.VARIANT} kernels; BASERT_CPU picks another)")
    header = f"{'case':13} {'N x K':>12} {'M':9} {'threads':7} {'time/call':>14} {'GFLOP/s':>15} {'weight GB/s':>11}"
    best: dict[tuple[str, str, str, int], Result] = {}
    for _ in range(args.repeat):
        print(header)
        results = [] if args.skip_shapes else bench_shapes(args.threads, args.m, args.min_time, rng)
        results += bench_model(args.threads, args.min_time, rng)
        for r in results:
            key = (r.case, r.shape, r.m, r.threads)
            if key not in best or r.us_per_call < best[key].us_per_call:
                best[key] = r
    results = list(best.values())
    if args.repeat > 1:
        print(f"best of {args.repeat} runs:\n{header}")
        for r in results:
            print_row(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)


if __name__ == "__main__":
    main()
