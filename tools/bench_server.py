"""Server benchmark: prefix reuse, concurrent decode throughput and peak RSS of `basert serve`.

    python tools/bench_server.py [--model M] [--threads N] [--parts a,b,c] [--configs ...] [--json PATH]
    python tools/bench_server.py --quick            # smoke run: small sizes, a minute or two

Each configuration runs in a fresh `basert serve` subprocess (started with ServerProcess on a free loopback
port, warmed up with one tiny unrelated completion, stopped with SIGTERM afterwards).

(a) Shared prefix: --requests (8) chat requests whose system message is the same made-up manual of about
    --prefix-tokens (4000) tokens, counted with /tokenize, each with a short distinct question and
    max_tokens 8; once sequentially and once with --concurrency (4) in flight, each on its own server,
    for the configs `baseline` (one slot, no prefix cache), `prefix-cache`, `batching` (4 slots),
    `batching+prefix-cache` and `default` (no flags: what `basert serve` does out of the box).
    Per request: prompt tokens, cached tokens, server prefill time and tok/s (the response `timings`,
    which count only uncached tokens, from the first prompt chunk computed, so queueing and waiting for a
    shared prefix that another request is computing are excluded) and client TTFT (send to the first chunk with
    non-empty content). Per batch: the makespan and the prefill-time ratio, the mean prefill time of the
    other requests divided by that of the request whose first token came first.
(b) Decode: --streams (1,2,4,8) simultaneous streams of distinct "write a long story" prompts with
    max_tokens --decode-tokens (128) and ignore_eos, on one server per config, for the configs `baseline`
    (one slot), `batching+prefix-cache` (4 slots), `continuous-batching` (8 slots) and `default`.
    aggregate tok/s = sum of completion tokens / (makespan - earliest first-token time), i.e. over the
    decode phase (not makespan - mean TTFT: without batching the streams queue, so later TTFTs include
    earlier streams' decode); raw tok/s = the same sum / makespan; per-stream tok/s = (completion
    tokens - 1) / (last chunk - first chunk), averaged over the streams.
(c) Peak RSS: VmHWM of each server process, read from /proc/PID/status just before it is stopped.

Configurations are data (CONFIGS), chosen with --configs; their flags follow the common ones
(--max-context, --threads), then --extra-flags (written --extra-flags="--paged-kv ...").
Server logs go to a temporary directory that is removed on success and reported on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import trio

from basert import __version__
from basert.cli.generate import model_path_for
from basert.testing.launcher import ServerProcess


@dataclass(frozen=True)
class Config:
    name: str
    part: str            # "a" or "b"
    flags: tuple[str, ...]


SINGLE_SLOT = ("--no-continuous-batching",)
CONFIGS = (
    Config("baseline", "a", (*SINGLE_SLOT, "--no-prefix-cache")),
    Config("prefix-cache", "a", (*SINGLE_SLOT, "--prefix-cache")),
    Config("batching", "a", ("--continuous-batching", "4", "--no-prefix-cache")),
    Config("batching+prefix-cache", "a", ("--continuous-batching", "4", "--prefix-cache")),
    Config("default", "a", ()),
    Config("baseline", "b", (*SINGLE_SLOT, "--no-prefix-cache")),
    Config("batching+prefix-cache", "b", ("--continuous-batching", "4", "--prefix-cache")),
    Config("continuous-batching", "b", ("--continuous-batching", "8")),
    Config("default", "b", ()),
)
ANSWER_TOKENS = 8
HTTP_TIMEOUT = httpx.Timeout(600.0)


@dataclass
class StreamResult:
    """One streamed chat completion, timed on the client; times are seconds since the batch started."""

    sent: float
    first_token: float | None = None
    last_chunk: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    timings: dict = field(default_factory=dict)

    @property
    def ttft_ms(self) -> float:
        return 1000 * ((self.first_token if self.first_token is not None else self.last_chunk) - self.sent)


@dataclass
class ServerRun:
    config: str
    part: str
    label: str
    flags: list[str]
    vm_hwm_mib: float
    vm_rss_mib: float


# ---------------------------------------------------------------------------------------------- requests


async def stream_chat(client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int,
                      start: float, ignore_eos: bool = False) -> StreamResult:
    body = {"messages": messages, "temperature": 0, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    result = StreamResult(sent=time.perf_counter() - start)
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"HTTP {response.status_code}: {response.text}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter() - start
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise RuntimeError(f"server error: {chunk['error']}")
            if any(choice["delta"].get("content") for choice in chunk.get("choices", [])):
                result.first_token = now if result.first_token is None else result.first_token
                result.last_chunk = now
            if chunk.get("usage"):
                usage = chunk["usage"]
                result.prompt_tokens = usage["prompt_tokens"]
                result.completion_tokens = usage["completion_tokens"]
                result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                result.timings = chunk.get("timings") or {}
    return result


async def run_batch(url: str, conversations: list[list[dict]], max_tokens: int, concurrency: int,
                    ignore_eos: bool = False) -> tuple[list[StreamResult], float]:
    """Send all conversations, at most `concurrency` in flight, in order; returns results and makespan (s)."""
    results: list[StreamResult | None] = [None] * len(conversations)
    errors: list[Exception] = []
    limiter = trio.CapacityLimiter(concurrency)
    start = time.perf_counter()

    async def one(index: int, client: httpx.AsyncClient, admitted: trio.Event, scope: trio.CancelScope) -> None:
        async with limiter:
            admitted.set()
            try:
                results[index] = await stream_chat(client, url, conversations[index], max_tokens, start,
                                                   ignore_eos)
            except (RuntimeError, httpx.HTTPError) as exc:  # report the first error, not an exception group
                errors.append(exc)
                scope.cancel()

    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT) as client, trio.open_nursery() as nursery:
        for index in range(len(conversations)):
            admitted = trio.Event()
            nursery.start_soon(one, index, client, admitted, nursery.cancel_scope)
            await admitted.wait()  # keep request order when the limiter is contended
    if errors:
        raise errors[0]
    makespan = time.perf_counter() - start
    return [r for r in results if r is not None], makespan


def warm_up(url: str) -> None:
    body = {"prompt": "0 1 2 3 4 5", "max_tokens": 2, "temperature": 0}
    httpx.post(f"{url}/v1/completions", json=body, timeout=HTTP_TIMEOUT).raise_for_status()


def count_tokens(url: str, text: str) -> int:
    response = httpx.post(f"{url}/tokenize", json={"content": text}, timeout=HTTP_TIMEOUT)
    response.raise_for_status()
    return len(response.json()["tokens"])


# ---------------------------------------------------------------------------------------------- servers


def memory_mib(pid: int) -> tuple[float, float]:
    """(VmHWM, VmRSS) of a process in MiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            fields[key] = int(value.split()[0]) / 1024
    return fields["VmHWM"], fields["VmRSS"]


class Bench:
    """Common settings plus the list of server runs (for part c)."""

    def __init__(self, model: Path, threads: int | None, extra_flags: list[str], log_dir: Path):
        self.model = model
        self.threads = threads
        self.extra_flags = extra_flags
        self.log_dir = log_dir
        self.runs: list[ServerRun] = []

    def flags(self, config: Config, max_context: int) -> list[str]:
        common = ["--max-context", str(max_context)]
        if self.threads is not None:
            common += ["--threads", str(self.threads)]
        return common + list(config.flags) + self.extra_flags

    def start(self, config: Config, label: str, max_context: int) -> tuple[ServerProcess, list[str]]:
        flags = self.flags(config, max_context)
        log_path = self.log_dir / f"{config.part}-{config.name}-{label}.log"
        progress(f"[{config.part}] {config.name} / {label}: starting basert serve {shlex.join(flags)}")
        try:
            server = ServerProcess(self.model, *flags, log_path=log_path)
        except RuntimeError:
            tail = "\n".join(log_path.read_text().splitlines()[-5:])
            raise RuntimeError(f"{config.name} / {label}: the server did not start:\n{tail}") from None
        return server, flags

    def finish(self, server: ServerProcess, config: Config, label: str, flags: list[str]) -> None:
        hwm, rss = memory_mib(server.process.pid)
        self.runs.append(ServerRun(config.name, config.part, label, flags, hwm, rss))


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


# ---------------------------------------------------------------------------------------------- part (a)

SUBSYSTEMS = ["coolant pump", "main valve", "pressure sensor", "drive belt", "control board", "intake filter",
              "heat exchanger", "relay bank", "fan assembly", "servo arm", "feed roller", "status panel"]
ACTIONS = ["inspect", "tighten", "recalibrate", "replace", "clean", "lubricate", "reset", "realign", "test"]
WHEN = ["every morning", "after each shift", "once a week", "when the amber light blinks", "before a cold start",
        "after 400 operating hours", "whenever the alarm sounds twice", "at the end of each month"]
DETAILS = ["using the hex key stored in drawer C", "with the power isolated at breaker {n}",
           "while a second operator watches gauge {n}", "and record the reading in log book {n}",
           "until the indicator reads {n} percent", "then wait {n} seconds before restarting"]


def manual_lines(count: int) -> list[str]:
    """Numbered, varied lines of a made-up maintenance manual (deterministic)."""
    rng = random.Random(0)
    lines = []
    for number in range(1, count + 1):
        detail = rng.choice(DETAILS).format(n=rng.randint(2, 97))
        lines.append(f"{number}. {rng.choice(ACTIONS).capitalize()} the {rng.choice(SUBSYSTEMS)} "
                     f"{rng.choice(WHEN)}, {detail}.")
    return lines


def build_prefix(url: str, target_tokens: int) -> tuple[str, int]:
    """A system message of about target_tokens tokens (at least that many); returns (text, tokens)."""
    header = "You are the assistant for the Model 7 press. Answer from this manual only.\n"
    lines = 64
    for _ in range(6):
        text = header + "\n".join(manual_lines(lines))
        tokens = count_tokens(url, text)
        if tokens >= target_tokens and tokens - target_tokens < 2 * tokens / lines:
            return text, tokens
        lines = max(1, round(lines * target_tokens / tokens) + (1 if tokens < target_tokens else 0))
    return text, tokens


def questions(count: int) -> list[str]:
    return [f"Question {i + 1}: what does line {7 * i + 3} of the manual say? Be brief." for i in range(count)]


@dataclass
class PrefixRun:
    config: str
    mode: str
    concurrency: int
    makespan_s: float
    prefill_ratio: float | None
    requests: list[dict]


def prefill_ratio(results: list[StreamResult]) -> float | None:
    """Mean prefill time of the other requests / prefill time of the request that got its first token first."""
    first = min(range(len(results)), key=lambda i: results[i].first_token or float("inf"))
    base = results[first].timings.get("prompt_ms", 0.0)
    others = [r.timings.get("prompt_ms", 0.0) for i, r in enumerate(results) if i != first]
    return statistics.mean(others) / base if others and base > 0 else None


def request_row(index: int, result: StreamResult) -> dict:
    return {"request": index + 1, "prompt_tokens": result.prompt_tokens, "cached_tokens": result.cached_tokens,
            "prefill_tokens": result.timings.get("prompt_n"), "prefill_ms": result.timings.get("prompt_ms"),
            "prefill_tokens_per_second": result.timings.get("prompt_per_second"), "ttft_ms": result.ttft_ms,
            "completion_tokens": result.completion_tokens}


def run_part_a(bench: Bench, configs: list[Config], prefix_tokens: int, requests: int, concurrency: int,
               max_context: int | None) -> tuple[list[PrefixRun], int]:
    runs: list[PrefixRun] = []
    measured_prefix = 0
    context = max_context or round_up(prefix_tokens + 512, 1024)
    for config in configs:
        for mode, in_flight in (("sequential", 1), (f"concurrent {concurrency}", concurrency)):
            server, flags = bench.start(config, mode.replace(" ", "-"), context)
            try:
                warm_up(server.url)
                system, measured_prefix = build_prefix(server.url, prefix_tokens)
                conversations = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
                                 for q in questions(requests)]
                results, makespan = trio.run(run_batch, server.url, conversations, ANSWER_TOKENS, in_flight)
                bench.finish(server, config, mode.replace(" ", "-"), flags)
            finally:
                server.stop()
            runs.append(PrefixRun(config.name, mode, in_flight, makespan, prefill_ratio(results),
                                  [request_row(i, r) for i, r in enumerate(results)]))
            progress(f"    makespan {makespan:.2f} s")
    return runs, measured_prefix


def fmt(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    return str(value) if isinstance(value, int) else f"{value:.{digits}f}"


def part_a_tables(runs: list[PrefixRun], prefix_tokens: int) -> str:
    lines = [f"### (a) shared prefix: {prefix_tokens} tokens (system message), max_tokens {ANSWER_TOKENS}", "",
             "| config | mode | req | prompt tok | cached tok | prefill tok | prefill ms | prefill tok/s | TTFT ms |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for run in runs:
        for row in run.requests:
            lines.append(f"| {run.config} | {run.mode} | {row['request']} | {row['prompt_tokens']} | "
                         f"{row['cached_tokens']} | {fmt(row['prefill_tokens'])} | {fmt(row['prefill_ms'])} | "
                         f"{fmt(row['prefill_tokens_per_second'])} | {row['ttft_ms']:.1f} |")
    lines += ["", "| config | mode | makespan s | mean TTFT ms | prefill ratio (others / first) |",
              "| --- | --- | ---: | ---: | ---: |"]
    for run in runs:
        mean_ttft = statistics.mean(row["ttft_ms"] for row in run.requests)
        lines.append(f"| {run.config} | {run.mode} | {run.makespan_s:.2f} | {mean_ttft:.1f} | "
                     f"{fmt(run.prefill_ratio, 3)} |")
    lines += ["", ("prefill ms and tok/s are the server's `timings` (uncached tokens only, from the first prompt "
                   "chunk computed: queueing and waiting for a shared prefix excluded); "
                   "TTFT is client-side, send to first content chunk, queueing included.")]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- part (b)

TOPICS = ["a lighthouse keeper", "a lost robot", "a dragon who bakes bread", "two rival chess players",
          "a city under the sea", "a time-travelling cat", "the last train home", "a garden on Mars"]


@dataclass
class DecodeRun:
    config: str
    streams: int
    makespan_s: float
    completion_tokens: int
    aggregate_tokens_per_second: float
    raw_tokens_per_second: float
    per_stream_tokens_per_second: float
    mean_ttft_ms: float
    stream_results: list[dict]


def stream_rate(result: StreamResult) -> float:
    if result.first_token is None or result.last_chunk <= result.first_token:
        return 0.0
    return (result.completion_tokens - 1) / (result.last_chunk - result.first_token)


def decode_run(config: str, streams: int, results: list[StreamResult], makespan: float) -> DecodeRun:
    total = sum(r.completion_tokens for r in results)
    first = min((r.first_token for r in results if r.first_token is not None), default=0.0)
    return DecodeRun(
        config=config, streams=streams, makespan_s=makespan, completion_tokens=total,
        aggregate_tokens_per_second=total / (makespan - first) if makespan > first else 0.0,
        raw_tokens_per_second=total / makespan,
        per_stream_tokens_per_second=statistics.mean(stream_rate(r) for r in results),
        mean_ttft_ms=statistics.mean(r.ttft_ms for r in results),
        stream_results=[{"completion_tokens": r.completion_tokens, "ttft_ms": r.ttft_ms,
                         "client_tokens_per_second": stream_rate(r),
                         "server_predicted_per_second": r.timings.get("predicted_per_second")} for r in results],
    )


def run_part_b(bench: Bench, configs: list[Config], stream_counts: list[int], decode_tokens: int,
               max_context: int | None) -> list[DecodeRun]:
    runs: list[DecodeRun] = []
    context = max_context or round_up(decode_tokens + 256, 256)
    for config in configs:
        server, flags = bench.start(config, "decode", context)
        try:
            warm_up(server.url)
            for streams in stream_counts:
                progress(f"[b] {config.name}: {streams} stream(s) x {decode_tokens} tokens")
                conversations = [[{"role": "user", "content": f"Write a long story about {TOPICS[i % len(TOPICS)]}."}]
                                 for i in range(streams)]
                results, makespan = trio.run(run_batch, server.url, conversations, decode_tokens, streams, True)
                runs.append(decode_run(config.name, streams, results, makespan))
                if runs[-1].completion_tokens < streams * decode_tokens:
                    progress("    note: some streams stopped before max_tokens (context full?)")
            bench.finish(server, config, "decode", flags)
        finally:
            server.stop()
    return runs


def part_b_table(runs: list[DecodeRun], decode_tokens: int) -> str:
    lines = [f"### (b) decode: max_tokens {decode_tokens}, ignore_eos, temperature 0", "",
             ("| config | streams | completion tok | makespan s | mean TTFT ms | aggregate tok/s | raw tok/s | "
              "per-stream tok/s |"),
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for run in runs:
        lines.append(f"| {run.config} | {run.streams} | {run.completion_tokens} | {run.makespan_s:.2f} | "
                     f"{run.mean_ttft_ms:.1f} | {run.aggregate_tokens_per_second:.1f} | "
                     f"{run.raw_tokens_per_second:.1f} | {run.per_stream_tokens_per_second:.1f} |")
    lines += ["", ("aggregate = sum of completion tokens / (makespan - earliest first token); raw = the same sum / "
                   "makespan; per-stream = mean over streams of (tokens - 1) / (last chunk - first chunk).")]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- part (c)


def part_c_table(runs: list[ServerRun]) -> str:
    lines = ["### (c) server memory: VmHWM (peak RSS) and VmRSS just before SIGTERM", "",
             "| part | config | run | flags | peak RSS MiB | RSS MiB |", "| --- | --- | --- | --- | ---: | ---: |"]
    for run in runs:
        lines.append(f"| {run.part} | {run.config} | {run.label} | `{shlex.join(run.flags)}` | "
                     f"{run.vm_hwm_mib:.1f} | {run.vm_rss_mib:.1f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    names = sorted({c.name for c in CONFIGS})
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", "-m", help=".base file or installed model id (default: smollm2)")
    parser.add_argument("--threads", "-t", type=int, default=None,
                        help="server threads (default: one per physical core)")
    parser.add_argument("--parts", default="a,b,c", help="comma-separated subset of a,b,c (c needs a or b)")
    parser.add_argument("--configs", default=",".join(names), help=f"comma-separated subset of {','.join(names)}")
    parser.add_argument("--prefix-tokens", type=int, default=4000, help="shared prefix length for (a)")
    parser.add_argument("--requests", type=int, default=8, help="requests sharing the prefix in (a)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight in the concurrent (a) run")
    parser.add_argument("--decode-tokens", type=int, default=128, help="max_tokens per stream in (b)")
    parser.add_argument("--streams", default="1,2,4,8", help="concurrent stream counts for (b)")
    parser.add_argument("--max-context", type=int, default=None,
                        help="server --max-context (default: prefix + 512 rounded up to 1024 for (a), "
                             "decode tokens + 256 rounded up to 256 for (b))")
    parser.add_argument("--extra-flags", default="",
                        help="flags appended to every `basert serve`; write --extra-flags='--paged-kv'")
    parser.add_argument("--quick", action="store_true",
                        help="smoke-run defaults: prefix 600 tokens, 4 requests, streams 1,2, 16 decode tokens")
    parser.add_argument("--json", type=Path, default=Path("bench_server.json"), help="where to write the JSON")
    if parser.parse_args().quick:  # smaller defaults; explicit options still win
        parser.set_defaults(prefix_tokens=600, requests=4, streams="1,2", decode_tokens=16)
    args = parser.parse_args()
    args.parts = set(args.parts.split(","))
    args.configs = set(args.configs.split(","))
    args.streams = [int(s) for s in args.streams.split(",")]
    if not args.parts <= {"a", "b", "c"} or not args.parts & {"a", "b"}:
        parser.error("--parts: a subset of a,b,c including a or b")
    if not args.configs <= set(names):
        parser.error(f"--configs: unknown {','.join(sorted(args.configs - set(names)))}")
    return args


def main() -> int:
    args = parse_args()
    model = model_path_for(args.model)
    selected = [c for c in CONFIGS if c.name in args.configs and c.part in args.parts]
    log_dir = Path(tempfile.mkdtemp(prefix="bench_server-"))
    bench = Bench(model, args.threads, shlex.split(args.extra_flags), log_dir)
    report: dict = {
        "basert_version": __version__,
        "machine": {"cpu_count": os.cpu_count(), "machine": platform.machine(), "system": platform.system(),
                    "python": platform.python_version()},
        "model": str(model),
        "model_bytes": model.stat().st_size,
        "threads": args.threads,
        "extra_flags": bench.extra_flags,
        "configs": {f"{c.part}:{c.name}": list(c.flags) for c in selected},
    }
    tables = []
    try:
        if "a" in args.parts:
            runs, prefix_tokens = run_part_a(bench, [c for c in selected if c.part == "a"], args.prefix_tokens,
                                             args.requests, args.concurrency, args.max_context)
            report["a"] = {"prefix_tokens": prefix_tokens, "requests": args.requests,
                           "concurrency": args.concurrency, "answer_tokens": ANSWER_TOKENS,
                           "runs": [asdict(r) for r in runs]}
            tables.append(part_a_tables(runs, prefix_tokens))
        if "b" in args.parts:
            runs_b = run_part_b(bench, [c for c in selected if c.part == "b"], args.streams, args.decode_tokens,
                                args.max_context)
            report["b"] = {"decode_tokens": args.decode_tokens, "ignore_eos": True,
                           "aggregate_definition": "sum of completion tokens / (makespan - earliest first token)",
                           "raw_definition": "sum of completion tokens / makespan",
                           "per_stream_definition": "mean over streams of (completion tokens - 1) / "
                                                    "(last content chunk - first content chunk)",
                           "runs": [asdict(r) for r in runs_b]}
            tables.append(part_b_table(runs_b, args.decode_tokens))
    except (RuntimeError, httpx.HTTPError) as exc:
        progress(f"error: {exc}\nserver logs kept in {log_dir}")
        return 1
    report["c"] = [asdict(r) for r in bench.runs]
    if "c" in args.parts:
        tables.append(part_c_table(bench.runs))
    shutil.rmtree(log_dir)
    print("\n\n".join(tables))
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    progress(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
