"""Where decode time goes: cProfile over N single-token forwards, split into kernels (_ext) and Python; for
models that decode through the C decode graph, also the share of the thread team's time spent waiting at
phase boundaries (synchronisation) rather than computing.

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
    graph = engine.runner.model.graph
    if graph is not None:
        graph.team_stats(reset=True)
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
    if graph is not None:
        team = graph.team_stats()
        members = len(team["wait_seconds"])
        waited = sum(team["wait_seconds"])
        share = waited / (members * team["seconds"]) if team["seconds"] else 0.0
        print(f"decode graph: {team['steps']} steps, {team['seconds']:.3f} s in the thread team; {members} members "
              f"waited {waited:.3f} s at phase boundaries = {100 * share:.1f}% of their time (synchronisation)\n")
    stats.sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
