"""Engine benchmark: pp128, pp512 and tg128 tokens/s plus peak RSS for one model; a table and JSON.

Memory: the process's peak RSS, and what the engine adds to it: the peak minus the RSS after the imports and before
the model loads, beside the weights (the .base file, mapped) and the KV pool that the engine allocated; the rest is
the engine's own working memory (activations, workspaces).

    python tools/bench_engine.py [MODEL] [--threads 2] [--repetitions 3] [--json bench_engine.json]
    python tools/bench_engine.py --with-load [--rounds 3]    # decode on a shared CPU

MODEL is a .base file or installed model id; default: the SmolLM2 default model (converted on first use).

--with-load measures tg128 alternately alone and beside one competing CPU-bound process (a Python busy
loop, started before and killed after each loaded measurement), for --rounds rounds, and prints the median
of each and their ratio: how much of its idle speed decode keeps when it shares the CPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
from pathlib import Path

from basert import __version__
from basert.cli.bench import markdown_table, run_bench
from basert.cli.generate import model_path_for


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", help=".base file or installed model id (default: smollm2)")
    parser.add_argument("--threads", "-t", type=int, default=None,
                        help="engine threads (default: one per physical core)")
    parser.add_argument("--repetitions", "-r", type=int, default=3)
    parser.add_argument("--warmup", "-w", type=int, default=1)
    parser.add_argument("--cache-type", "-ct", default="f16", help="KV type of K and V (default f16)")
    parser.add_argument("--json", type=Path, default=Path("bench_engine.json"), help="where to write the JSON")
    parser.add_argument("--with-load", action="store_true",
                        help="tg128 alone and beside one busy process, alternately; print both and the ratio")
    parser.add_argument("--rounds", type=int, default=3, help="alternations for --with-load (default 3)")
    args = parser.parse_args()

    path = model_path_for(args.model)
    if args.with_load:
        return bench_with_load(path, args)
    before_mib = current_rss_mib()
    kv: dict[str, int] = {}
    results = run_bench(path, [128, 512], [128], args.repetitions, args.warmup, args.threads, (args.cache_type,) * 2,
                        on_engine=lambda engine: kv.update(bytes=engine.runner.kv.nbytes))
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    added_mib, weights_mib, kv_mib = peak_rss_mib - before_mib, path.stat().st_size / 2**20, kv["bytes"] / 2**20
    name = path.parent.parent.name if path.name == "model.base" else path.name
    print(markdown_table(name, path.stat().st_size, results))
    print(f"\npeak RSS: {peak_rss_mib:.1f} MiB; added by the engine: {added_mib:.1f} MiB = weights {weights_mib:.1f} + "
          f"KV {kv_mib:.1f} + {added_mib - weights_mib - kv_mib:.1f} MiB")
    report = {
        "basert_version": __version__,
        "model": str(path),
        "model_bytes": path.stat().st_size,
        "threads": args.threads,
        "cache_type": args.cache_type,
        "machine": platform.machine(),
        "python": platform.python_version(),
        "results": [{"test": r.test, "tokens_per_second_mean": r.mean, "tokens_per_second_stdev": r.stdev,
                     "runs_tokens_per_second": r.rates} for r in results],
        "peak_rss_mib": peak_rss_mib,
        "rss_before_load_mib": before_mib,
        "engine_added_rss_mib": added_mib,
        "weights_mib": weights_mib,
        "kv_mib": kv_mib,
    }
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}", file=sys.stderr)
    return 0


def current_rss_mib() -> float:
    """The process's resident memory now (Linux: /proc/self/statm), with every engine module imported."""
    import basert.engine.build  # noqa: F401  (imported before the baseline, so that it does not count as the engine's)

    with open("/proc/self/statm") as statm:
        resident_pages = int(statm.read().split()[1])
    return resident_pages * resource.getpagesize() / 2**20


def bench_with_load(path: Path, args: argparse.Namespace) -> int:
    """tg128 alone and beside a busy process, alternating; the medians and their ratio."""
    idle: list[float] = []
    loaded: list[float] = []
    for round_number in range(1, args.rounds + 1):
        [alone] = run_bench(path, [], [128], args.repetitions, args.warmup, args.threads, (args.cache_type,) * 2)
        idle += alone.rates
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            [shared] = run_bench(path, [], [128], args.repetitions, args.warmup, args.threads, (args.cache_type,) * 2)
        finally:
            busy.kill()
            busy.wait()
        loaded += shared.rates
        print(f"round {round_number}: alone {alone.mean:.1f} tok/s, beside a busy process {shared.mean:.1f} tok/s",
              file=sys.stderr)
    ratio = statistics.median(loaded) / statistics.median(idle)
    print("| test | alone t/s (median) | beside 1 busy process t/s (median) | ratio |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| tg128 | {statistics.median(idle):.1f} | {statistics.median(loaded):.1f} | {ratio:.2f} |")
    report = {"basert_version": __version__, "model": str(path), "threads": args.threads,
              "idle_tokens_per_second": idle, "loaded_tokens_per_second": loaded, "ratio_of_medians": ratio}
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
