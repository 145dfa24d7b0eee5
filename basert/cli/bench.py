"""`basert bench`: prefill (ppN) and decode (tgN) tokens per second, llama-bench style."""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from basert._ext.kvtypes import KV_TYPES
from basert.cli.flags import add_exact_flag

if TYPE_CHECKING:
    from basert.engine.engine import Engine


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


def fill_context(engine, depth_tokens: list[int], slot: int = 0) -> None:
    """Give the slot exactly `depth_tokens` of history (not timed). What the slot holds from the run before is reused
    as far as it agrees (the prefix cache's rule), so a deep context is computed once for all the runs at that depth,
    not once per run (llama-bench keeps its depth state alike)."""
    if depth_tokens:
        engine.prefill(depth_tokens, slot)
    else:
        engine.erase(slot)


def time_prefill(engine, depth_tokens: list[int], tokens: list[int]) -> float:
    """One forward over the tokens after `depth_tokens` of context."""
    fill_context(engine, depth_tokens)
    started = time.perf_counter()
    engine.prefill(depth_tokens + tokens)   # the context is reused: only `tokens` are computed
    return time.perf_counter() - started


def time_decode(engine, depth_tokens: list[int], n_tokens: int, first_tokens: list[int]) -> float:
    """n_tokens steps after `depth_tokens` of context; each step is one forward that appends a token to each of
    len(first_tokens) sequences (one per slot) and feeds back each sequence's argmax."""
    from basert.engine.runner import ForwardRequest

    for slot in range(len(first_tokens)):
        fill_context(engine, depth_tokens, slot)
    sequences = [engine.slots[slot].sequence for slot in range(len(first_tokens))]
    tokens = list(first_tokens)
    started = time.perf_counter()
    for _ in range(n_tokens):
        logits = engine.runner.forward([ForwardRequest(seq, [tok]) for seq, tok in zip(sequences, tokens)])
        tokens = [int(np.argmax(rows[0])) for rows in logits]
    return time.perf_counter() - started


def time_generation(engine, context: list[int], n_tokens: int, batch: int) -> float:
    """`batch` requests generating n_tokens greedy tokens each after `context`, through the engine's scheduler
    (speculative decoding as the engine is set up); the time from the first token on."""
    from basert.engine.sampler import SamplingParams
    from basert.engine.types import GenerationRequest, TokenEvent

    for slot in range(batch):
        engine.erase(slot)
    greedy = SamplingParams(temperature=0)
    requests = [GenerationRequest(f"bench{i}", [*context, i], n_tokens, greedy, ignore_eos=True)
                for i in range(batch)]
    started = None
    for event in engine.generate(requests):
        if started is None and isinstance(event, TokenEvent):
            started = time.perf_counter()
    return time.perf_counter() - started


def repeating_context(rng: np.random.Generator, vocab_size: int, depth: int) -> list[int]:
    """Text that repeats itself, so that drafts from the history are right: random tokens, then the same again
    (at least 256 tokens before the repetition)."""
    piece = rng.integers(0, vocab_size, max(depth, 256)).tolist()
    return piece + piece[:16]


def run_bench(path: Path, prompt_sizes: list[int], gen_sizes: list[int], repetitions: int, warmup: int,
              threads: int | None = None, cache_types: tuple[str, str] = ("f16", "f16"),
              depths: tuple[int, ...] = (0,),
              batch: int = 1, on_engine: Callable[[Engine], None] | None = None,
              spec: int | None = None) -> list[BenchResult]:
    """Measure each ppN and tgN at each context depth `repetitions` times after `warmup` unrecorded runs; tgN
    decodes `batch` sequences together (their tokens summed in the rate). `on_engine`, if given, is called with the
    engine once it is built (a benchmark that reports its memory reads the KV pool's size there).

    With `spec` (the most drafted tokens per step; 0: none), tgN generates through the engine's scheduler with
    speculative decoding after a context that repeats itself, whose continuation the drafts can guess."""
    from basert.engine import EngineOptions, build_engine

    max_context = max(depths + (256,) if spec is not None else depths) + max(prompt_sizes + gen_sizes + [16]) + 32
    engine = build_engine(path, EngineOptions(max_context=max_context, threads=threads, cache_type_k=cache_types[0],
                                              cache_type_v=cache_types[1],
                                              n_slots=batch, paged_kv=batch > 1, continuous_batching=batch > 1,
                                              spec_draft_max=spec or 0))
    if on_engine is not None:
        on_engine(engine)
    rng = np.random.default_rng(0)
    results = []
    try:
        for depth in depths:
            context = rng.integers(0, engine.info.vocab_size, depth).tolist()
            at = f" @ d{depth}" if depth else ""
            for n in (n for n in prompt_sizes if n > 0):   # 0 skips the test, as in llama-bench
                tokens = rng.integers(0, engine.info.vocab_size, n).tolist()
                for _ in range(warmup):
                    time_prefill(engine, context, tokens)
                seconds = [time_prefill(engine, context, tokens) for _ in range(repetitions)]
                results.append(BenchResult(f"pp{n}{at}", n, seconds))
            for n in (n for n in gen_sizes if n > 0):
                name = f"tg{n}{' x' + str(batch) if batch > 1 else ''}{at}"
                if spec is not None:
                    repeating = repeating_context(rng, engine.info.vocab_size, depth)
                    for _ in range(warmup):
                        time_generation(engine, repeating, n, batch)
                    seconds = [time_generation(engine, repeating, n, batch) for _ in range(repetitions)]
                    results.append(BenchResult(f"{name} spec{spec}", (n - 1) * batch, seconds))
                    continue
                first = rng.integers(0, engine.info.vocab_size, batch).tolist()
                for _ in range(warmup):
                    time_decode(engine, context, n, first)
                seconds = [time_decode(engine, context, n, first) for _ in range(repetitions)]
                results.append(BenchResult(name, n * batch, seconds))
    finally:
        engine.close()
    return results


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def kernel_variant() -> str:
    """The CPU variant of the kernels this process runs (imports them)."""
    import basert._ext

    return basert._ext.VARIANT


def use_variant(variant: str) -> None:
    """Make this process run the `variant` kernels: set BASERT_CPU before they are imported; once another
    variant is loaded (a module cannot be unloaded), run this command again in a fresh process with it set."""
    if "basert._ext" not in sys.modules:
        os.environ["BASERT_CPU"] = variant
    elif kernel_variant() != variant:
        argv = [sys.executable, "-m", "basert", *sys.argv[1:]]
        os.execve(sys.executable, argv, {**os.environ, "BASERT_CPU": variant})


def markdown_table(model_name: str, size_bytes: int, results: list[BenchResult]) -> str:
    size = f"{size_bytes / 2**20:.2f} MiB"
    lines = ["| model | size | test | t/s |", "| --- | ---: | ---: | ---: |"]
    for r in results:
        lines.append(f"| {model_name} | {size} | {r.test} | {r.mean:.2f} ± {r.stdev:.2f} |")
    return "\n".join(lines)


def cmd_bench(args: argparse.Namespace) -> int:
    from basert.cli.generate import model_path_for
    from basert.engine.build import ModelOptionsError
    from basert.engine.runner import default_threads

    if args.variant:
        use_variant(args.variant)
    path = model_path_for(args.model)
    if min(args.depth) < 0 or args.batch < 1 or (args.spec is not None and not 0 <= args.spec <= 64):
        print("error: -d needs depths >= 0, -b a batch >= 1 and --spec a K in [0, 64]", file=sys.stderr)
        return 2
    try:
        results = run_bench(path, args.n_prompt, args.n_gen, args.repetitions, args.warmup, args.threads,
                            (args.cache_type_k, args.cache_type_v), tuple(args.depth), args.batch, spec=args.spec)
    except ModelOptionsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{cpu_model()} ({kernel_variant()} kernels), {args.threads or default_threads()} threads", file=sys.stderr)
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
    p.add_argument("-d", "--depth", type=int, nargs="+", default=[0], metavar="N",
                   help="run each test after N tokens of context (default 0); test names get ' @ dN'")
    p.add_argument("-b", "--batch", type=int, default=1, metavar="N",
                   help="tgN decodes N sequences together in one batched forward per step; the rate counts "
                   "every sequence's tokens (default 1)")
    p.add_argument("-r", "--repetitions", type=int, default=5, help="measured runs per test (default 5)")
    p.add_argument("-w", "--warmup", type=int, default=1, help="unmeasured runs first (default 1)")
    p.add_argument("-t", "--threads", type=int, help="engine threads (default: one per physical core)")
    add_exact_flag(p)
    p.add_argument("--variant", choices=("portable", "avx2", "avx512"),
                   help="the CPU variant of the kernels (default: the best this CPU runs; same as BASERT_CPU)")
    p.add_argument("--cache-type-k", "-ctk", default="f16", metavar="TYPE",
                   help=f"how K rows are stored in the KV cache: {', '.join(KV_TYPES)} (default f16)")
    p.add_argument("--cache-type-v", "-ctv", default="f16", metavar="TYPE",
                   help=f"how V rows are stored in the KV cache: {', '.join(KV_TYPES)} (default f16)")
    p.add_argument("--spec", type=int, metavar="K",
                   help="speculative decoding mode: tgN generates greedily through the engine's scheduler with up "
                   "to K drafted tokens per step (0: none, the comparison) after a context that repeats itself "
                   "(random tokens, then their start again), so drafts from the history are right; the rate "
                   "counts the tokens after the first")
    p.set_defaults(func=cmd_bench)
