"""Decode against the memory floor: how close tgN comes to reading every weight once per token at the
machine's read bandwidth.

    python tools/bench_floor.py [MODEL] [--threads N] [-n 128] [--repetitions 3] [--json bench_floor.json]

1. Read bandwidth: `threads` Python threads (the engine's count) each sum their slice of a 1 GiB float32
   buffer with numpy (which releases the GIL in reductions), repeated; the best pass counts.
2. Bytes per token: every tensor of the .base file is read once per decoded token, except the embedding
   table when the head has its own matrix (a lookup reads one row). The KV cache adds 2 x layers x kv dim x
   2 bytes per position of context: small at the depths of tgN and left out.
3. floor tok/s = bandwidth / bytes per token; tgN is measured with `basert bench`'s decode loop in the same
   run, and printed as a share of the floor.
4. Matmul alone: every weight matrix those bytes hold (the 2-D tensors) multiplied by one activation row with
   the engine's kernels and thread count, one call per matrix, best of several rounds: the tokens/s the
   kernels allow with nothing else to do. When it is well below the floor, decode is bound by the kernels'
   arithmetic, not by memory.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from bench_matmul import seconds_per_call

from basert._ext import matmul as mm
from basert.cli.bench import cpu_model, kernel_variant, run_bench
from basert.cli.generate import model_path_for
from basert.engine.runner import default_threads
from basert.format import open_base
from basert.models.layers import Weights

BUFFER_BYTES = 1 << 30


def read_bandwidth(threads: int, passes: int = 5) -> float:
    """Bytes per second that `threads` threads read, summing disjoint slices of one buffer (best of `passes`)."""
    data = np.ones(BUFFER_BYTES // 4, dtype=np.float32)
    slices = np.array_split(data, threads)
    best = 0.0
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(np.sum, slices))   # first touch and thread start-up are not measured
        for _ in range(passes):
            started = time.perf_counter()
            list(pool.map(np.sum, slices))
            best = max(best, data.nbytes / (time.perf_counter() - started))
    return best


def bytes_per_token(path: Path) -> int:
    """Bytes of the tensors one decode step reads (decode_tensors)."""
    with open_base(path) as base:
        return sum(base.tensors[name].length for name in decode_tensors(base.tensors))


def decode_tensors(tensors: dict) -> list[str]:
    """Names of the tensors one decode step reads: all of them but an embedding table with a separate head."""
    skipped = "embed_tokens.weight" if "lm_head.weight" in tensors else None
    return [name for name in tensors if name != skipped]


def matmul_alone_seconds(path: Path, threads: int) -> float:
    """Seconds of one pass of every weight matrix a decode step reads against one activation row (the best of
    several rounds), with the engine's kernels on `threads` threads."""
    with open_base(path) as base:
        weights = Weights(base)
        shapes = {name: base.tensors[name].array_shape for name in decode_tensors(base.tensors)}
        rng = np.random.default_rng(0)
        calls = [(rng.standard_normal((1, w.k), dtype=np.float32), w, np.empty((1, w.n), dtype=np.float32))
                 for w in (weights.matrix(name, *shape) for name, shape in shapes.items() if len(shape) == 2)]
        mm.set_num_threads(threads)

        def one_pass() -> None:
            for x, w, out in calls:
                mm.matmul(x, w, out)

        return seconds_per_call(one_pass, min_time=1.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", help=".base file or installed model id (default: smollm2)")
    parser.add_argument("--threads", "-t", type=int, default=None, help="engine threads (default: the engine's)")
    parser.add_argument("-n", "--n-gen", type=int, default=128, help="tokens decoded per run (default 128)")
    parser.add_argument("--repetitions", "-r", type=int, default=3)
    parser.add_argument("--json", type=Path, default=Path("bench_floor.json"), help="where to write the JSON")
    args = parser.parse_args()

    path = model_path_for(args.model)
    threads = args.threads or default_threads()
    bandwidth = read_bandwidth(threads)
    per_token = bytes_per_token(path)
    floor = bandwidth / per_token
    matmul_alone = 1.0 / matmul_alone_seconds(path, threads)
    [tg] = run_bench(path, [], [args.n_gen], args.repetitions, 1, args.threads)
    share = tg.mean / floor
    print(f"| CPU | kernels | threads | read GB/s | MB per token | floor tok/s | matmul alone tok/s | "
          f"tg{args.n_gen} tok/s | share of floor |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print(f"| {cpu_model()} | {kernel_variant()} | {threads} |"
          f" {bandwidth / 1e9:.1f} | {per_token / 1e6:.1f} | {floor:.0f} | "
          f"{matmul_alone:.0f} ({matmul_alone / floor:.0%}) | "
          f"{tg.mean:.1f} ± {tg.stdev:.1f} | {share:.0%} |")
    report = {"cpu": cpu_model(), "variant": kernel_variant(), "threads": threads, "model": str(path),
              "read_bytes_per_second": bandwidth, "bytes_per_token": per_token, "floor_tokens_per_second": floor,
              "matmul_alone_tokens_per_second": matmul_alone, "tg_tokens_per_second": tg.rates,
              "share_of_floor": share}
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
