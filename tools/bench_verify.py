"""What verifying a draft costs: seconds of one forward that feeds T tokens of one sequence (the next token and
T - 1 drafted ones, logits at every position, as a speculative step does) against one that feeds a single token, at
a given depth of context.

    python tools/bench_verify.py [MODEL] [--depths 0 4096] [--tokens 1 2 3 4 6 8 12 16] [--rounds 5] [--threads N]

A draft of T - 1 tokens of which a are accepted turns one step into a + 1 tokens; it pays when a + 1 exceeds the cost
ratio the table gives (the engine measures the same ratios as it runs, StepCosts in basert/engine/drafts.py, and
drafts only where the expected acceptance pays for them). Per depth the sequence is prefilled once with `depth`
tokens of a fixed pseudo-random prompt; each measured forward then appends T tokens and the sequence is rewound to
`depth`, so every size is timed at the same depth. The sizes are timed in turn, round after round (a machine's speed
drifts between minutes), and the table gives each size's median over the rounds, and its ratio to one token's.
Step sizes up to the decode graph's limit (models/plan.py: MAX_GRAPH_TOKENS) run as one C call; larger ones take the
per-kernel path, as the engine would run them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from basert.cli.bench import cpu_model, kernel_variant
from basert.cli.generate import model_path_for
from basert.engine import EngineOptions, build_engine
from basert.engine.runner import ForwardRequest, default_threads


def step_seconds(engine, sequence, depth: int, tokens: list[int]) -> float:
    """Seconds of one forward of `tokens` after the sequence's first `depth` positions (rewound after it)."""
    started = time.perf_counter()
    engine.runner.forward([ForwardRequest(sequence, tokens, "all")])
    seconds = time.perf_counter() - started
    engine.runner.rewind(sequence, depth)
    return seconds


def measure_depth(engine, depth: int, sizes: list[int], rounds: int, rng: np.random.Generator) -> dict[int, float]:
    """Median seconds of a step of each size at `depth` (sizes alternated within every round)."""
    vocab = engine.runner.vocab_size
    sequence = engine.slots[0].sequence
    engine.runner.rewind(sequence, 0)
    if depth:
        engine.prefill(rng.integers(0, vocab, depth).tolist())
    feed = rng.integers(0, vocab, max(sizes)).tolist()
    step_seconds(engine, sequence, depth, feed[:max(sizes)])   # warm the workspaces for the largest size
    times: dict[int, list[float]] = {size: [] for size in sizes}
    for _ in range(rounds):
        for size in sizes:
            times[size].append(step_seconds(engine, sequence, depth, feed[:size]))
    return {size: statistics.median(values) for size, values in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", help=".base file or installed model id (default: smollm2)")
    parser.add_argument("--depths", type=int, nargs="+", default=[0, 4096], help="context depths (default 0 4096)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16],
                        help="tokens fed per step (default 1 2 3 4 6 8 12 16; 1 is always measured)")
    parser.add_argument("--rounds", type=int, default=5, help="times each size is timed per depth (default 5)")
    parser.add_argument("--threads", "-t", type=int, default=None, help="engine threads (default: the engine's)")
    parser.add_argument("--json", type=Path, default=Path("bench_verify.json"), help="where to write the JSON")
    args = parser.parse_args()
    if min(args.tokens + args.depths) < 0 or min(args.tokens) < 1 or args.rounds < 1:
        parser.error("--tokens must be >= 1, --depths >= 0, --rounds >= 1")

    path = model_path_for(args.model)
    threads = args.threads or default_threads()
    sizes = sorted(set(args.tokens) | {1})
    engine = build_engine(path, EngineOptions(max_context=max(args.depths) + max(sizes) + 16, threads=threads))
    rng = np.random.default_rng(0)
    results = {}
    for depth in args.depths:
        results[depth] = measure_depth(engine, depth, sizes, args.rounds, rng)
        print(f"depth {depth} done", file=sys.stderr)
    engine.close()

    print(f"{cpu_model()} ({kernel_variant()} kernels), {threads} threads, {path.name}, medians of {args.rounds}\n")
    header = "| depth | " + " | ".join(f"T={size}" for size in sizes) + " |"
    print(header)
    print("|" + " --- |" * (header.count("|") - 1))
    for depth, seconds in results.items():
        one = seconds[1]
        cells = [f"{seconds[size] * 1e3:.1f} ms" + ("" if size == 1 else f" ({seconds[size] / one:.2f}x)")
                 for size in sizes]
        print(f"| {depth} | " + " | ".join(cells) + " |")
    report = {"cpu": cpu_model(), "variant": kernel_variant(), "threads": threads, "model": str(path),
              "rounds": args.rounds, "seconds": {str(d): {str(s): v for s, v in r.items()} for d, r in results.items()}}
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
