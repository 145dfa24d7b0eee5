"""`basert bench`: prefill (ppN) and decode (tgN) tokens per second, llama-bench style."""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True, slots=True)
class BenchResult:
    test: str
    n_tokens: int
    seconds: list[float]

    @property
    def rates(self) -> list[float]:
        return [self.n_tokens / s for s in self.seconds]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.rates)

    @property
    def stdev(self) -> float:
        return statistics.stdev(self.rates) if len(self.rates) > 1 else 0.0


def time_prefill(runner, tokens: np.ndarray) -> float:
    from basert.engine.runner import ForwardRequest

    seq = runner.new_sequence()
    started = time.perf_counter()
    runner.forward([ForwardRequest(seq, tokens)])
    elapsed = time.perf_counter() - started
    runner.release(seq)
    return elapsed


def time_decode(runner, n_tokens: int, first_token: int) -> float:
    """n_tokens single-token forwards from an empty sequence, each feeding back the argmax."""
    from basert.engine.runner import ForwardRequest

    seq = runner.new_sequence()
    token = first_token
    started = time.perf_counter()
    for _ in range(n_tokens):
        logits = runner.forward([ForwardRequest(seq, [token])])[0]
        token = int(np.argmax(logits[0]))
    elapsed = time.perf_counter() - started
    runner.release(seq)
    return elapsed


def run_bench(path: Path, prompt_sizes: list[int], gen_sizes: list[int], repetitions: int, warmup: int,
              threads: int | None = None, kv_bits: int = 16) -> list[BenchResult]:
    """Measure each ppN and tgN `repetitions` times after `warmup` unrecorded runs."""
    from basert.engine.runner import ModelRunner

    max_context = max(prompt_sizes + gen_sizes + [16])
    runner = ModelRunner(path, max_context=max_context, threads=threads,
                         kv_dtype=np.float16 if kv_bits == 16 else np.float32)
    rng = np.random.default_rng(0)
    results = []
    try:
        for n in prompt_sizes:
            tokens = rng.integers(0, runner.vocab_size, n).astype(np.int32)
            for _ in range(warmup):
                time_prefill(runner, tokens)
            results.append(BenchResult(f"pp{n}", n, [time_prefill(runner, tokens) for _ in range(repetitions)]))
        for n in gen_sizes:
            first = int(rng.integers(0, runner.vocab_size))
            for _ in range(warmup):
                time_decode(runner, n, first)
            results.append(BenchResult(f"tg{n}", n, [time_decode(runner, n, first) for _ in range(repetitions)]))
    finally:
        runner.close()
    return results


def markdown_table(model_name: str, size_bytes: int, results: list[BenchResult]) -> str:
    size = f"{size_bytes / 2**20:.2f} MiB"
    lines = ["| model | size | test | t/s |", "| --- | ---: | ---: | ---: |"]
    for r in results:
        lines.append(f"| {model_name} | {size} | {r.test} | {r.mean:.2f} ± {r.stdev:.2f} |")
    return "\n".join(lines)


def cmd_bench(args: argparse.Namespace) -> int:
    from basert.cli.generate import model_path_for

    path = model_path_for(args.model)
    results = run_bench(path, args.n_prompt, args.n_gen, args.repetitions, args.warmup, args.threads,
                        args.kv_bits)
    print(markdown_table(path.parent.parent.name if path.name == "model.base" else path.name,
                         path.stat().st_size, results))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure prefill and decode speed (llama-bench style)",
                       description="Measure prompt processing (ppN: one forward over N tokens) and text "
                       "generation (tgN: N single-token forwards) in tokens per second; prints a "
                       "markdown table with mean ± stddev over the repetitions.")
    p.add_argument("model", nargs="?", help="a .base file or installed model id (default: smollm2)")
    p.add_argument("-p", "--n-prompt", type=int, nargs="+", default=[512], help="prompt sizes (default 512)")
    p.add_argument("-n", "--n-gen", type=int, nargs="+", default=[128], help="generation lengths (default 128)")
    p.add_argument("-r", "--repetitions", type=int, default=5, help="measured runs per test (default 5)")
    p.add_argument("-w", "--warmup", type=int, default=1, help="unmeasured runs first (default 1)")
    p.add_argument("-t", "--threads", type=int, help="engine threads (default: all cores)")
    p.add_argument("--kv-bits", type=int, choices=(16, 32), default=16, help="KV element width (default 16)")
    p.set_defaults(func=cmd_bench)
