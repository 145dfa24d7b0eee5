"""llama.cpp beside BaseRT on the same GGUF: `llama-bench` and `basert bench` alternately, medians and ratios.

    LLAMA_BENCH=/path/to/llama-bench python tools/bench_pair.py MODEL.gguf [MODEL.gguf ...] [--rounds 3]
        [--threads 2] [-p 512] [-n 128] [-d 0 4096] [--json bench_pair.json]

Each round runs, for each GGUF in turn, llama-bench (`-o json`, the same prompt sizes, generation lengths, depths
and threads, --repetitions runs per test), then BaseRT's bench on the same GGUF (converted into the models
directory on first use, `--target auto`: its blocks kept as they are). The table gives, per GGUF and test, the
median over the rounds of each side's mean tokens/s and the ratio basert / llama.cpp; with several GGUFs it has
one row per GGUF and test, with the file's name in its first column.

llama-bench is built from the llama.cpp sources that the `llama-cpp-python` sdist vendors
(`pip download --no-deps --no-binary llama-cpp-python llama-cpp-python`, then in vendor/llama.cpp:
`cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF && cmake --build build -j --target llama-bench`,
5-20 minutes); it is never a dependency of BaseRT. Models of sizes that no package ships (1B and 3B Llama shapes,
as K-quants too) come from tools/make_synthetic_gguf.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from basert.cli.bench import cpu_model, kernel_variant, run_bench
from basert.cli.generate import model_path_for


def test_name(n_prompt: int, n_gen: int, depth: int) -> str:
    """BaseRT's name of a llama-bench test: ppN or tgN, with ' @ dD' after a context."""
    name = f"pp{n_prompt}" if n_prompt else f"tg{n_gen}"
    return f"{name} @ d{depth}" if depth else name


def run_llama_bench(binary: str, gguf: Path, args: argparse.Namespace) -> dict[str, float]:
    """Mean tokens/s per test from one llama-bench run."""
    command = [binary, "-m", str(gguf), "-p", ",".join(map(str, args.n_prompt)),
               "-n", ",".join(map(str, args.n_gen)), "-d", ",".join(map(str, args.depth)),
               "-t", str(args.threads), "-r", str(args.repetitions), "-o", "json"]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"llama-bench failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
    rows = json.loads(result.stdout)
    return {test_name(row["n_prompt"], row["n_gen"], row.get("n_depth", 0)): row["avg_ts"] for row in rows}


def run_basert(path: Path, args: argparse.Namespace) -> dict[str, float]:
    """Mean tokens/s per test from one BaseRT bench run."""
    results = run_bench(path, args.n_prompt, args.n_gen, args.repetitions, 1, args.threads,
                        depths=tuple(args.depth))
    return {r.test: r.mean for r in results}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf", type=Path, nargs="+", help="the GGUFs both sides run (one or more)")
    parser.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"),
                        help="path of llama-bench (default: $LLAMA_BENCH)")
    parser.add_argument("--rounds", type=int, default=3, help="alternations (default 3)")
    parser.add_argument("--threads", "-t", type=int, default=os.cpu_count() or 1, help="threads on both sides")
    parser.add_argument("-p", "--n-prompt", type=int, nargs="+", default=[512])
    parser.add_argument("-n", "--n-gen", type=int, nargs="+", default=[128])
    parser.add_argument("-d", "--depth", type=int, nargs="+", default=[0])
    parser.add_argument("-r", "--repetitions", type=int, default=3, help="runs per test in each round (default 3)")
    parser.add_argument("--json", type=Path, default=Path("bench_pair.json"), help="where to write the JSON")
    args = parser.parse_args()
    if not args.llama_bench:
        parser.error("give --llama-bench PATH or set LLAMA_BENCH")

    paths = [model_path_for(str(gguf)) for gguf in args.gguf]
    llama: list[dict[str, list[float]]] = [defaultdict(list) for _ in args.gguf]
    basert: list[dict[str, list[float]]] = [defaultdict(list) for _ in args.gguf]
    for round_number in range(1, args.rounds + 1):
        for gguf, path, theirs, ours in zip(args.gguf, paths, llama, basert):
            for test, rate in run_llama_bench(args.llama_bench, gguf, args).items():
                theirs[test].append(rate)
            for test, rate in run_basert(path, args).items():
                ours[test].append(rate)
        print(f"round {round_number}/{args.rounds} done", file=sys.stderr)

    several = len(args.gguf) > 1
    models = f"{len(args.gguf)} GGUFs" if several else args.gguf[0].name
    print(f"{cpu_model()} ({kernel_variant()} kernels), {args.threads} threads, {models}, "
          f"medians of {args.rounds} alternations\n")
    print(("| model " if several else "") + "| test | llama.cpp t/s | basert t/s | basert / llama.cpp |")
    print(("| --- " if several else "") + "| --- | ---: | ---: | ---: |")
    report = {"cpu": cpu_model(), "variant": kernel_variant(), "threads": args.threads, "rounds": args.rounds}
    entries = []
    for gguf, theirs_by_test, ours_by_test in zip(args.gguf, llama, basert):
        tests, prefix = {}, f"| {gguf.name} " if several else ""
        for test in ours_by_test:
            ours = statistics.median(ours_by_test[test])
            theirs = statistics.median(theirs_by_test[test]) if theirs_by_test.get(test) else float("nan")
            print(f"{prefix}| {test} | {theirs:.1f} | {ours:.1f} | {ours / theirs:.2f}x |")
            tests[test] = {"llama_cpp": theirs_by_test.get(test, []), "basert": ours_by_test[test]}
        entries.append({"gguf": str(gguf), "tests": tests})
    if several:
        report["models"] = entries
    else:
        report |= entries[0]
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
