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


def time_prefill(engine, tokens: list[int]) -> float:
    """One forward over the tokens from an empty slot."""
    engine.erase(0)
    started = time.perf_counter()
    engine.prefill(tokens)
    return time.perf_counter() - started


def time_decode(engine, n_tokens: int, first_token: int) -> float:
    """n_tokens single-token forwards from an empty slot, each feeding back the argmax."""
    engine.erase(0)
    token = first_token
    started = time.perf_counter()
    for _ in range(n_tokens):
        token = int(np.argmax(engine.decode(token)))
    return time.perf_counter() - started


def run_bench(path: Path, prompt_sizes: list[int], gen_sizes: list[int], repetitions: int, warmup: int,
              threads: int | None = None, kv_bits: int = 16) -> list[BenchResult]:
    """Measure each ppN and tgN `repetitions` times after `warmup` unrecorded runs."""
    from basert.engine import EngineOptions, build_engine

    max_context = max(prompt_sizes + gen_sizes + [16])
    engine = build_engine(path, EngineOptions(max_context=max_context, threads=threads, kv_bits=kv_bits))
    rng = np.random.default_rng(0)
    results = []
    try:
        for n in prompt_sizes:
            tokens = rng.integers(0, engine.info.vocab_size, n).tolist()
            for _ in range(warmup):
                time_prefill(engine, tokens)
            results.append(BenchResult(f"pp{n}", n, [time_prefill(engine, tokens) for _ in range(repetitions)]))
        for n in gen_sizes:
            first = int(rng.integers(0, engine.info.vocab_size))
            for _ in range(warmup):
                time_decode(engine, n, first)
            results.append(BenchResult(f"tg{n}", n, [time_decode(engine, n, first) for _ in range(repetitions)]))
    finally:
        engine.close()
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
