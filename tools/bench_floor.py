"""Decode against the memory floor: how close tgN comes to reading every weight once per token at the
machine's read bandwidth.

    python tools/bench_floor.py [MODEL] [--threads N] [-n 128] [--repetitions 3] [--rounds 3] [--json bench_floor.json]

1. Read bandwidth: `threads` Python threads (the engine's count) each take the max of their slice of a 1 GiB
   buffer of bytes with numpy (SIMD byte compares, far below any memory's rate in work, and numpy releases the
   GIL in reductions), repeated; the best pass counts. (A float32 sum, used before, ran below the memory's rate
   on a Zen 3 core: 22-27 GB/s on two cores where the byte max read 28-40, which set the floor too low.)
2. Bytes per token: every tensor of the .base file is read once per decoded token, except the embedding
   table when the head has its own matrix (a lookup reads one row). The KV cache adds 2 x layers x kv dim x
   2 bytes per position of context: small at the depths of tgN and left out.
3. floor tok/s = bandwidth / bytes per token; tgN is measured with `basert bench`'s decode loop in the same
   run, and printed as a share of the floor. A machine's speed can drift between minutes, so each of --rounds
   rounds measures the bandwidth, then tgN, then the bandwidth again, and takes that round's share against the
   mean of its two bandwidths; the table gives the median of the rounds' shares (and each of them).
4. Matmul alone: every weight matrix those bytes hold (the 2-D tensors) multiplied by one activation row with
   the engine's kernels and thread count (the LM head's row quantized to the engine's HEAD_ACT_BITS, the others to
   8 bits, as decode quantizes them), one call per matrix, best of several rounds: the tokens/s the
   kernels allow with nothing else to do. When it is well below the floor, decode is bound by the kernels'
   arithmetic, not by memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
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
from basert.models.transformer import HEAD_ACT_BITS, head_tensor

BUFFER_BYTES = 1 << 30


def read_bandwidth(data: np.ndarray, threads: int, passes: int = 5) -> float:
    """Bytes per second that `threads` threads read, each taking the max of a disjoint slice of `data` (best of
    `passes`)."""
    slices = np.array_split(data, threads)
    best = 0.0
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(np.max, slices))   # thread start-up is not measured
        for _ in range(passes):
            started = time.perf_counter()
            list(pool.map(np.max, slices))
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
        head = head_tensor(base.tensors.__contains__)
        rng = np.random.default_rng(0)
        matrices = [weights.matrix(name, *shape, act_bits=HEAD_ACT_BITS if name == head else 8)
                    for name, shape in shapes.items() if len(shape) == 2]
        calls = [(rng.standard_normal((1, w.k), dtype=np.float32), w, np.empty((1, w.n), dtype=np.float32))
                 for w in matrices]
        mm.set_num_threads(threads)

        def one_pass() -> None:
            for x, w, out in calls:
                mm.matmul(x, w, out)

        return seconds_per_call(one_pass, min_time=1.0)


def measure_round(path: Path, threads: int, per_token: int, buffer: np.ndarray, args: argparse.Namespace) -> dict:
    """One round: the read bandwidth over `buffer`, tgN, the bandwidth again; tgN's share of the floor the two
    bandwidths' mean gives."""
    before = read_bandwidth(buffer, threads)
    [tg] = run_bench(path, [], [args.n_gen], args.repetitions, 1, threads)
    after = read_bandwidth(buffer, threads)
    bandwidth = (before + after) / 2
    return {"read_bytes_per_second": bandwidth, "read_bytes_per_second_before_after": [before, after],
            "tg_tokens_per_second": tg.mean, "tg_runs_tokens_per_second": tg.rates,
            "share_of_floor": tg.mean / (bandwidth / per_token)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", help=".base file or installed model id (default: smollm2)")
    parser.add_argument("--threads", "-t", type=int, default=None, help="engine threads (default: the engine's)")
    parser.add_argument("-n", "--n-gen", type=int, default=128, help="tokens decoded per run (default 128)")
    parser.add_argument("--repetitions", "-r", type=int, default=3, help="tgN runs per round (default 3)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of bandwidth, tgN, bandwidth; the median share is reported (default 3)")
    parser.add_argument("--json", type=Path, default=Path("bench_floor.json"), help="where to write the JSON")
    args = parser.parse_args()

    path = model_path_for(args.model)
    threads = args.threads or default_threads()
    per_token = bytes_per_token(path)
    matmul_alone = 1.0 / matmul_alone_seconds(path, threads)
    buffer = np.ones(BUFFER_BYTES, dtype=np.uint8)   # touched once here, read by every round
    rounds = [measure_round(path, threads, per_token, buffer, args) for _ in range(args.rounds)]
    shares = [r["share_of_floor"] for r in rounds]
    bandwidth = statistics.median(r["read_bytes_per_second"] for r in rounds)
    tg = statistics.median(r["tg_tokens_per_second"] for r in rounds)
    floor = bandwidth / per_token
    print(f"| CPU | kernels | threads | read GB/s | MB per token | floor tok/s | matmul alone tok/s | "
          f"tg{args.n_gen} tok/s | share of floor (rounds) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print(f"| {cpu_model()} | {kernel_variant()} | {threads} |"
          f" {bandwidth / 1e9:.1f} | {per_token / 1e6:.1f} | {floor:.0f} | "
          f"{matmul_alone:.0f} ({matmul_alone / floor:.0%}) | "
          f"{tg:.1f} | {statistics.median(shares):.0%} ({', '.join(f'{x:.0%}' for x in shares)}) |")
    report = {"cpu": cpu_model(), "variant": kernel_variant(), "threads": threads, "model": str(path),
              "bytes_per_token": per_token, "matmul_alone_tokens_per_second": matmul_alone, "rounds": rounds,
              "read_bytes_per_second": bandwidth, "floor_tokens_per_second": floor, "tg_tokens_per_second": tg,
              "share_of_floor": statistics.median(shares)}
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
