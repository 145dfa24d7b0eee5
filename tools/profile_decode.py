"""Where decode time goes: cProfile over N single-token forwards, split into kernels (_ext) and Python.

    python tools/profile_decode.py [MODEL] [-n 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys

import numpy as np

from basert.cli.generate import model_path_for
from basert.engine import EngineOptions, build_engine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?")
    parser.add_argument("-n", type=int, default=128)
    parser.add_argument("--threads", "-t", type=int)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    engine = build_engine(model_path_for(args.model), EngineOptions(max_context=args.n + 16, threads=args.threads))
    token = 1
    engine.decode(token)  # warm the workspaces
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.n):
        token = int(np.argmax(engine.decode(token)))
    profiler.disable()
    stats = pstats.Stats(profiler)
    total = stats.total_tt
    in_ext = sum(tt for (filename, _, name), (_, _, tt, _, _) in stats.stats.items()
                 if "basert._ext" in name or "_ext/" in filename)
    print(f"{args.n} decode steps: {total:.3f} s ({args.n / total:.1f} tokens/s under the profiler)")
    print(f"inside _ext kernels: {in_ext:.3f} s = {100 * in_ext / total:.1f}% of decode time\n")
    stats.sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
