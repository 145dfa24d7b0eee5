"""Micro-benchmark of basert._ext.attention on SmolLM2-135M shapes (9 query heads, 3 kv heads, head dim 64).

Cases: decode of one sequence (and of a batch of 4) after D positions, and a prefill chunk of P new tokens
after D positions, over a cache of one KV type (f16 by default; --cache-type f32, bf16, q8_0). Each time is the
best of several rounds of attention_batch calls for one layer (bench_matmul's seconds_per_call); "model tok/s"
scales it to the 30 attention layers of the model (attention alone, no matmuls). To compare two builds, run this
file with each on PYTHONPATH, alternately.
Run: python tools/bench_attention.py [--depth 4096 16384] [--prefill 512] [--threads 1 2] [--cache-type q8_0]
     [--json results.json]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

import numpy as np
from bench_matmul import seconds_per_call

from basert._ext import attention as attn
from basert._ext import matmul as mm
from basert._ext.kvtypes import KV_TYPES, KVType, encode, kv_type

HEADS, KV_HEADS, HEAD_DIM, LAYERS, BLOCK = 9, 3, 64, 30, 16


@dataclass(slots=True)
class Result:
    case: str
    depth: int
    threads: int
    ms_per_call: float
    model_tok_s: float


def run_case(depth: int, n_seq: int, new_tokens: int, kv: KVType, rng: np.random.Generator) -> tuple[float, int]:
    """Seconds of one attention_batch call: n_seq sequences, each new_tokens after depth cached positions."""
    total = depth + new_tokens
    per_seq = -(-total // BLOCK)
    k_cache, v_cache = (encode(kv, rng.standard_normal((per_seq * n_seq, KV_HEADS, BLOCK, HEAD_DIM))) for _ in "kv")
    tables = rng.permutation(per_seq * n_seq).astype(np.int32).reshape(n_seq, per_seq)
    q = rng.standard_normal((n_seq * new_tokens, HEADS, HEAD_DIM)).astype(np.float32)
    out = np.empty_like(q)
    rows = (np.arange(n_seq) * new_tokens).astype(np.int32)
    lengths = np.full(n_seq, new_tokens, dtype=np.int32)
    starts = np.full(n_seq, depth, dtype=np.int32)

    def call() -> None:
        attn.attention_batch(q, k_cache, v_cache, tables, rows, lengths, starts, 0.125, out)

    return seconds_per_call(call, min_time=1.0), n_seq * new_tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depth", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--prefill", type=int, default=512, help="new tokens of the prefill case (0: none)")
    parser.add_argument("--threads", type=int, nargs="+", default=[2])
    parser.add_argument("--cache-type", default="f16", choices=list(KV_TYPES), help="KV type (default f16)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    kv = kv_type(args.cache_type)
    rng = np.random.default_rng(0)
    results = []
    print(f"segment {attn.SEGMENT}, kv {kv.name}")
    print("| case | depth | threads | ms/call | model tok/s |\n| --- | ---: | ---: | ---: | ---: |")
    for threads in args.threads:
        mm.set_num_threads(threads)
        for depth in args.depth:
            cases = [("decode x1", 1, 1), ("decode x4", 4, 1)]
            if args.prefill:
                cases.append((f"prefill {args.prefill}", 1, args.prefill))
            for name, n_seq, new_tokens in cases:
                seconds, tokens = run_case(depth, n_seq, new_tokens, kv, rng)
                r = Result(name, depth, threads, seconds * 1e3, tokens / (seconds * LAYERS))
                results.append(r)
                print(f"| {r.case} | {r.depth} | {r.threads} | {r.ms_per_call:.3f} | {r.model_tok_s:.1f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
