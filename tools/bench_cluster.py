"""Cluster benchmark: prefix-affinity routing against round robin on a K-conversation workload, and the latency the
cluster adds to one completion.

    python tools/bench_cluster.py [--model M] [--replicas 2] [--threads-per-replica 1] [--conversations 12]
                                  [--turns 4] [--clients 8] [--system-tokens 2000] [--json PATH]
    python tools/bench_cluster.py --quick      # smaller prompts and fewer turns: a few minutes

(a) Routing: for each policy (`prefix`, then `round-robin`) a fresh `basert cluster` (local Ray) serves
    --conversations conversations, each with its own made-up system prompt of about --system-tokens tokens,
    each of --turns turns (a short new question, max_tokens --max-tokens, greedy), sent by --clients client
    threads: a client takes a conversation's next turn whenever it is free, so the turns of one conversation
    never overlap. With the defaults the conversations' prompts (about 12 x 2,100 tokens) overflow one replica's
    prefix cache (4 slots x 4,096 tokens) but fit in two: round robin makes each replica hold them all, affinity
    half of them each. Reported: requests/s and generated tok/s over the makespan, the cached share of prompt tokens
    (usage.prompt_tokens_details.cached_tokens / prompt_tokens), and the requests each replica served
    (X-BaseRT-Replica).
(b) Latency: one 128-token completion (ignore_eos), --latency-runs times, alternating between a direct
    `basert serve` with the replicas' threads and the cluster (the prefix policy), with distinct prompts so no
    run finds another's prefix cached; the medians and their ratio.

Server and cluster logs go to a temporary directory that is removed on success and reported on failure.
"""

from __future__ import annotations

import argparse
import json
import platform
import queue
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from basert import __version__
from basert.cli.bench import cpu_model
from basert.cli.generate import model_path_for
from basert.testing.cluster import ClusterProcess
from basert.testing.launcher import ServerProcess

WORDS = ("ledger", "harbour", "copper", "meadow", "signal", "lantern", "orchard", "quarry", "velvet", "summit",
         "cobalt", "tundra", "falcon", "prism", "canyon", "beacon")


def system_prompt(index: int, n_tokens: int) -> str:
    """A made-up manual of about `n_tokens` tokens, different for every conversation from its first words."""
    sentences = []
    for i in range(n_tokens // 20):     # a sentence is about 20 tokens
        a, b, c = (WORDS[(index * 7 + i * k) % len(WORDS)] for k in (1, 3, 5))
        sentences.append(f"Rule {i} of desk {index}: the {a} goes beside the {b}, never the {c}.")
    return f"You are the assistant of desk {index}. " + " ".join(sentences)


def run_workload(url: str, args: argparse.Namespace) -> dict:
    """Every conversation's turns in order, --clients at a time; totals and per-replica counts."""
    conversations = [[{"role": "system", "content": system_prompt(i, args.system_tokens)}]
                     for i in range(args.conversations)]
    ready: queue.Queue[int] = queue.Queue()
    for index in range(args.conversations):
        ready.put(index)
    turns_left = [args.turns] * args.conversations
    lock = threading.Lock()
    totals = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0}
    per_replica: dict[str, int] = {}
    errors: list[str] = []
    pending = [args.conversations * args.turns]

    def client() -> None:
        with httpx.Client(base_url=url, timeout=600) as http:
            while True:
                with lock:
                    if pending[0] == 0 or errors:
                        return
                try:
                    index = ready.get(timeout=0.1)
                except queue.Empty:
                    continue
                messages = conversations[index]
                turn = args.turns - turns_left[index]
                messages.append({"role": "user", "content": f"Question {turn + 1}: what does rule {turn} say?"})
                response = http.post("/v1/chat/completions", json={
                    "model": "bench", "messages": messages, "max_tokens": args.max_tokens, "temperature": 0})
                with lock:
                    if response.status_code != 200:
                        errors.append(f"{response.status_code}: {response.text[:300]}")
                        return
                    body = response.json()
                    usage = body["usage"]
                    totals["requests"] += 1
                    totals["prompt_tokens"] += usage["prompt_tokens"]
                    totals["cached_tokens"] += usage["prompt_tokens_details"]["cached_tokens"]
                    totals["completion_tokens"] += usage["completion_tokens"]
                    replica = response.headers.get("x-basert-replica", "?")
                    per_replica[replica] = per_replica.get(replica, 0) + 1
                    messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
                    turns_left[index] -= 1
                    pending[0] -= 1
                if turns_left[index]:
                    ready.put(index)

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(args.clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    if errors:
        raise RuntimeError(f"requests failed: {errors[0]}")
    return {**totals, "seconds": round(seconds, 2), "requests_per_s": round(totals["requests"] / seconds, 3),
            "generated_tok_per_s": round(totals["completion_tokens"] / seconds, 2),
            "cached_share": round(totals["cached_tokens"] / max(1, totals["prompt_tokens"]), 3),
            "per_replica": dict(sorted(per_replica.items()))}


def completion_seconds(url: str, run: int) -> float:
    body = {"model": "bench", "prompt": f"Run {run}: a story about the {WORDS[run % len(WORDS)]} keeper.",
            "max_tokens": 128, "temperature": 0, "ignore_eos": True}
    started = time.perf_counter()
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    seconds = time.perf_counter() - started
    if response.status_code != 200 or response.json()["usage"]["completion_tokens"] != 128:
        raise RuntimeError(f"latency run failed: {response.status_code} {response.text[:300]}")
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model to serve (default: the default SmolLM2)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--threads-per-replica", type=int, default=1)
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--latency-runs", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="--system-tokens 600 --turns 3 --latency-runs 3")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.quick:
        args.system_tokens, args.turns, args.latency_runs = 600, 3, 3
    model = model_path_for(args.model)
    logs = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    flags = ("--threads-per-replica", str(args.threads_per_replica), "--alias", "bench")
    results: dict = {"version": __version__, "cpu": cpu_model(), "machine": platform.machine(),
                     "model": str(model), "settings": {k: v for k, v in vars(args).items() if k != "json"}}
    try:
        results["routing"] = {}
        for policy in ("prefix", "round-robin"):
            print(f"routing {policy}: starting {args.replicas} replicas", file=sys.stderr)
            cluster = ClusterProcess(model, *flags, "--routing", policy, replicas=args.replicas,
                                     log_path=logs / f"cluster-{policy}.log")
            try:
                results["routing"][policy] = run_workload(cluster.url, args)
            finally:
                cluster.stop()
            print(f"  {results['routing'][policy]}", file=sys.stderr)
        print("latency: a direct server and the cluster, alternating", file=sys.stderr)
        direct = ServerProcess(model, "--threads", str(args.threads_per_replica), "--alias", "bench",
                               log_path=logs / "direct.log")
        cluster = ClusterProcess(model, *flags, replicas=args.replicas, log_path=logs / "cluster-latency.log")
        try:
            completion_seconds(direct.url, 1000)
            completion_seconds(cluster.url, 1001)    # warm both
            times: dict[str, list[float]] = {"direct": [], "cluster": []}
            for run in range(args.latency_runs):
                times["direct"].append(completion_seconds(direct.url, 2 * run))
                times["cluster"].append(completion_seconds(cluster.url, 2 * run + 1))
        finally:
            direct.stop()
            cluster.stop()
        medians = {name: statistics.median(values) for name, values in times.items()}
        results["latency"] = {"direct_s": round(medians["direct"], 3), "cluster_s": round(medians["cluster"], 3),
                              "ratio": round(medians["cluster"] / medians["direct"], 3),
                              "runs": {name: [round(v, 3) for v in values] for name, values in times.items()}}
    except Exception:
        print(f"benchmark failed; logs kept in {logs}", file=sys.stderr)
        raise
    shutil.rmtree(logs, ignore_errors=True)
    prefix, robin = results["routing"]["prefix"], results["routing"]["round-robin"]
    print(f"\nCPU: {results['cpu']}; {args.replicas} replicas x {args.threads_per_replica} thread(s); "
          f"{args.conversations} conversations x {args.turns} turns, ~{args.system_tokens}-token system prompts, "
          f"{args.clients} clients")
    print("| routing | requests/s | generated tok/s | cached share | per replica | seconds |")
    print("|---|---:|---:|---:|---|---:|")
    for name, row in (("prefix affinity", prefix), ("round robin", robin)):
        print(f"| {name} | {row['requests_per_s']:.3f} | {row['generated_tok_per_s']:.1f} | "
              f"{row['cached_share']:.1%} | {row['per_replica']} | {row['seconds']:.1f} |")
    print(f"\nthroughput ratio (prefix / round robin): {prefix['requests_per_s'] / robin['requests_per_s']:.2f}x")
    latency = results["latency"]
    print(f"128-token completion: direct {latency['direct_s']:.3f} s, cluster {latency['cluster_s']:.3f} s "
          f"(x{latency['ratio']:.3f})")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
