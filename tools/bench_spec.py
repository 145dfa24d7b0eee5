"""Speculative decoding on agent traffic: decode speed with and without drafts, on a fixed workload set.

    python tools/bench_spec.py [--model M ...] [--rounds 3] [--threads N] [--json bench_spec.json]
    LLAMA_SERVER=/path/to/llama-server python tools/bench_spec.py --gguf MODEL.gguf   # llama-server beside

The workloads (tools/spec_workloads/workloads.json, committed; a message's `{NAME.txt}` is the text of that file
beside it): (a) `tool_calls`, an agent's next tool call after it read three files (`tool_choice` required, one
call), its arguments copying a path and quoted code from them; (b) `code_edit`, a ~300-line Python file returned
with one name changed (the first max_tokens of it); (c) `extraction`, a JSON-schema constrained extraction that
quotes its source; (d) `prose`, a story, the control whose text does not repeat its context. Each is sent as a
chat completion (temperature 0, streamed) to a `basert serve` with speculative decoding (its default) and to one
with `--no-spec`, alternating, `--rounds` times, each round on freshly started servers (so that no draft comes
from an earlier round's answer to the same workload): single stream (each workload alone, in the order above),
then `--concurrent` (4) copies of the code edit at once.

Per request the decode rate is (completion tokens - 1) / (last chunk - first chunk) on the client; for the
concurrent batch the aggregate is the sum of those tokens over (last chunk of any stream - first chunk of any).
The table gives the medians of the rates over the rounds and the median of the rounds' ratios on / off (each
round's two servers measured back to back: the machine's speed drifts between rounds). With LLAMA_SERVER set (and
--gguf, the same weights as a GGUF), llama-server runs the same workloads without speculation and with each
--spec-type of `--llama-spec-types`, `--llama-rounds` times each, and the table adds its ratios: the speedup of its
best type beside ours.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import trio

from basert.cli.bench import cpu_model, kernel_variant
from basert.cli.generate import model_path_for
from basert.testing.launcher import ServerProcess, free_port, wait_healthy

WORKLOADS = Path(__file__).resolve().parent / "spec_workloads"


def load_workloads() -> dict[str, dict]:
    """The workloads, each message's `{NAME.txt}` replaced by the text of that file of the workloads' folder."""
    workloads = json.loads((WORKLOADS / "workloads.json").read_text())
    texts = {f"{{{path.name}}}": path.read_text() for path in WORKLOADS.glob("*.txt")}
    for workload in workloads.values():
        for message in workload["messages"]:
            for placeholder, text in texts.items():
                message["content"] = message["content"].replace(placeholder, text)
    return workloads


@dataclass
class Stream:
    tokens: int = 0
    first: float = 0.0
    last: float = 0.0

    @property
    def rate(self) -> float:
        return (self.tokens - 1) / (self.last - self.first) if self.tokens > 1 and self.last > self.first else 0.0


async def stream_chat(client: httpx.AsyncClient, url: str, workload: dict) -> Stream:
    body = {"model": "default", "messages": workload["messages"], "temperature": 0, "stream": True,
            "max_tokens": workload["max_tokens"], "stream_options": {"include_usage": True}}
    for field in ("tools", "tool_choice", "parallel_tool_calls", "response_format"):
        if field in workload:
            body[field] = workload[field]
    stream = Stream()
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: {response.status_code} {(await response.aread()).decode()[:500]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            if chunk.get("choices") and any(choice.get("delta") for choice in chunk["choices"]):
                stream.first = stream.first or now
                stream.last = now
            if chunk.get("usage"):
                stream.tokens = chunk["usage"]["completion_tokens"]
    return stream


async def run_streams(url: str, workloads: list[dict]) -> list[Stream]:
    results: list[Stream | None] = [None] * len(workloads)
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(index: int) -> None:
            results[index] = await stream_chat(client, url, workloads[index])

        async with trio.open_nursery() as nursery:
            for index in range(len(workloads)):
                nursery.start_soon(one, index)
    return results


def aggregate(streams: list[Stream]) -> float:
    tokens = sum(s.tokens - 1 for s in streams if s.tokens > 1)
    span = max(s.last for s in streams) - min(s.first for s in streams)
    return tokens / span if span > 0 else 0.0


class LlamaServer:
    """llama-server on a GGUF, started for one configuration and stopped after it."""

    def __init__(self, binary: str, gguf: Path, threads: int, flags: list[str], log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log.open("w")
        self.process = subprocess.Popen([binary, "-m", str(gguf), "--port", str(self.port), "-t", str(threads),
                                         "-c", "32768", "-np", "4", "--jinja", *flags],
                                        stdout=self.log, stderr=subprocess.STDOUT)
        if not wait_healthy(self.url, 300, lambda: self.process.poll() is None):
            self.stop()
            raise RuntimeError(f"llama-server {' '.join(flags)} did not start; see {log}")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)
        self.log.close()


def measure(url: str, workloads: dict[str, dict], concurrent: int) -> dict[str, float]:
    """Single-stream rate of each workload, then the aggregate of `concurrent` code edits at once."""
    rates = {}
    for name, workload in workloads.items():
        rates[name] = trio.run(run_streams, url, [workload])[0].rate
    rates[f"code_edit x{concurrent}"] = aggregate(trio.run(run_streams, url, [workloads["code_edit"]] * concurrent))
    return rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="a .base file or model id (default smollm2)")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of on and off (default 3)")
    parser.add_argument("--threads", "-t", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--concurrent", type=int, default=4, help="code edits at once in the batch test")
    parser.add_argument("--gguf", type=Path, help="the same weights as a GGUF, for llama-server")
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"),
                        help="path of llama-server (default: $LLAMA_SERVER; none: basert only)")
    parser.add_argument("--llama-spec-types", default="ngram-simple,ngram-mod,ngram-map-k",
                        help="llama-server --spec-type values to try (comma-separated)")
    parser.add_argument("--llama-rounds", type=int, help="rounds of each llama-server configuration (default --rounds)")
    parser.add_argument("--json", type=Path, default=Path("bench_spec.json"))
    args = parser.parse_args()
    if args.llama_server and not args.gguf:
        parser.error("llama-server needs --gguf: the model as a GGUF")

    workloads = load_workloads()
    path = model_path_for(args.model)
    common = ["--threads", str(args.threads), "--max-context", "8192", "--slots", str(args.concurrent)]
    configs = {"off": ["--no-spec"], "on": []}
    runs: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as logs:
        for round_number in range(1, args.rounds + 1):
            # Fresh servers each round: drafts come from what this round's requests wrote, never from an earlier
            # round's answers to the same workload.
            for name, flags in configs.items():
                with ServerProcess(path, *common, *flags, log_path=Path(logs) / f"{name}.log") as server:
                    for test, rate in measure(server.url, workloads, args.concurrent).items():
                        runs.setdefault(name, {}).setdefault(test, []).append(rate)
            print(f"round {round_number}/{args.rounds} done", file=sys.stderr)
        if args.llama_server:
            for flags_name, flags in [("llama off", [])] + [
                    (f"llama {kind}", ["--spec-type", kind]) for kind in args.llama_spec_types.split(",")]:
                server = LlamaServer(args.llama_server, args.gguf, args.threads, flags,
                                     Path(logs) / f"{flags_name.replace(' ', '_')}.log")
                try:
                    for _ in range(args.llama_rounds or args.rounds):
                        for test, rate in measure(server.url, workloads, args.concurrent).items():
                            runs.setdefault(flags_name, {}).setdefault(test, []).append(rate)
                finally:
                    server.stop()

    medians = {name: {test: statistics.median(rates) for test, rates in tests.items()} for name, tests in runs.items()}
    llama_types = [name for name in medians if name.startswith("llama ") and name != "llama off"]
    print(f"{cpu_model()} ({kernel_variant()} kernels), {args.threads} threads, {path.name}, "
          f"medians of {args.rounds} rounds, decode tok/s\n")
    header = "| workload | basert off | basert on | ratio |"
    if llama_types:
        header += " llama.cpp off | best ngram type | llama.cpp ratio | ratio of ratios |"
    print(header)
    print("|" + " --- |" * (header.count("|") - 1))
    ratios = {test: statistics.median(on / off for on, off in zip(runs["on"][test], runs["off"][test]))
              for test in runs["off"]}
    for test, off in medians["off"].items():
        row = f"| {test} | {off:.1f} | {medians['on'][test]:.1f} | {ratios[test]:.2f}x |"
        if llama_types:
            base = medians["llama off"][test]
            best = max(llama_types, key=lambda name: medians[name][test])
            theirs = medians[best][test] / base
            row += f" {base:.1f} | {best[6:]} {medians[best][test]:.1f} | {theirs:.2f}x | {ratios[test] / theirs:.2f} |"
        print(row)
    args.json.write_text(json.dumps({"cpu": cpu_model(), "threads": args.threads, "model": str(path),
                                     "rounds": args.rounds, "runs": runs, "medians": medians, "ratios": ratios},
                                    indent=2) + "\n")
    print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
