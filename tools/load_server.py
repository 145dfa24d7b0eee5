"""Load `basert serve` with many clients and check that it stays healthy, bounded and clean afterwards.

    python tools/load_server.py --url http://127.0.0.1:8080 --clients 100 --seconds 60
    python tools/load_server.py --model model.base --serve-args "--continuous-batching 4 --prefix-cache"

--clients clients loop for --seconds: chat completions, about half streamed, with short prompts and
max_tokens up to --max-tokens; a third share one long system prompt (prefix reuse); some streaming clients
hang up after the first event. Reports requests completed, errors by status and code, latency and time to
first token (p50/p99), refusals (503/429) and those without Retry-After, /health latency (polled every
0.5 s), the server's RSS before, at peak (VmHWM) and after (when this tool started it, or with --pid), and the
slots after the run. Exits 1 on a malformed response, a refusal without Retry-After, /health over 1 s, a slot
still processing 10 s after the run, or RSS after > RSS before + 100 MiB. --json FILE writes the results.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import trio

from basert.testing.health import HealthLog, poll_health

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fuzz_server import envelope_problem, served, strict_json

HEALTH_LIMIT_S = 1.0
RSS_GROWTH_LIMIT = 100 * 1024 * 1024
QUESTIONS = ["What is the capital of France?", "Say hello.", "Name a colour.", "Count to three.", "What is 2+2?",
             "Give me a short word.", "Describe the sea in one sentence.", "What day comes after Monday?",
             "Name an animal.", "Write a haiku about rain."]
SYSTEM = ("You are the support assistant of a small bicycle shop. " +
          " ".join(f"Rule {i}: answer briefly, stay polite, and mention the opening hours only when asked."
                   for i in range(1, 13)))


@dataclass(slots=True)
class LoadState:
    started: int = 0
    completed: int = 0
    streamed: int = 0
    disconnected: int = 0
    errors: Counter = field(default_factory=Counter)
    refusals: int = 0
    refusals_without_retry_after: int = 0
    malformed: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    health: HealthLog = field(default_factory=lambda: HealthLog(HEALTH_LIMIT_S))
    rss_samples: list[int] = field(default_factory=list)


def read_proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process in bytes (empty if it is gone)."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def error_key(status: int, body: bytes) -> str:
    try:
        error = json.loads(body).get("error") or {}
        return f"{status} {error.get('code')}"
    except (ValueError, AttributeError):
        return f"{status} ?"


async def one_request(client: httpx.AsyncClient, rng: random.Random, args: argparse.Namespace,
                      state: LoadState) -> float:
    """Send one chat completion and record how it went; returns the seconds to wait before the next."""
    stream = rng.random() < args.stream_fraction
    messages = [{"role": "user", "content": f"{rng.choice(QUESTIONS)} (#{rng.randrange(10**6)})"}]
    if rng.random() < args.shared_prefix_fraction:
        messages.insert(0, {"role": "system", "content": SYSTEM})
    body = {"messages": messages, "max_tokens": rng.randint(1, args.max_tokens), "stream": stream,
            "temperature": rng.choice([0, 0.7])}
    disconnect = stream and rng.random() < args.disconnect_fraction
    state.started += 1
    start = time.monotonic()
    try:
        with trio.fail_after(args.timeout):
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    data = await response.aread()
                    check_refusal(response, data, state)
                    if response.status_code in (429, 503):   # back off as a polite client would, 5 s at most
                        retry_after = response.headers.get("retry-after", "1")
                        return min(5.0, float(retry_after)) if retry_after.isdigit() else 1.0
                    return 0.0
                if not stream:
                    data = await response.aread()
                    value = strict_json(data)
                    choices = value.get("choices") if isinstance(value, dict) else None
                    if not isinstance(choices, list) or not choices:
                        state.malformed.append(f"no choices: {data[:200]!r}")
                        return 0.0
                    state.latencies.append(time.monotonic() - start)
                    state.completed += 1
                    return 0.0
                await read_stream(response, start, disconnect, state)
    except trio.TooSlowError:
        state.errors["timeout"] += 1
    except (ValueError, UnicodeError) as exc:
        state.malformed.append(f"not strict JSON: {exc}")
    except httpx.HTTPError as exc:
        state.errors[type(exc).__name__] += 1
    return 0.0


def check_refusal(response: httpx.Response, data: bytes, state: LoadState) -> None:
    key = error_key(response.status_code, data)
    state.errors[key] += 1
    problem = envelope_problem(data, {k.lower(): v for k, v in response.headers.items()})
    if problem:
        state.malformed.append(f"{response.status_code}: {problem}")
    if response.status_code in (429, 503):
        state.refusals += 1
        if "retry-after" not in response.headers:
            state.refusals_without_retry_after += 1


async def read_stream(response: httpx.Response, start: float, disconnect: bool, state: LoadState) -> None:
    first = None
    done = False
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        payload = line[6:]
        if payload == "[DONE]":
            done = True
            break
        event = strict_json(payload.encode())
        if not isinstance(event, dict):
            state.malformed.append(f"SSE event is not an object: {payload[:200]}")
            continue
        if "error" in event:
            error = event["error"] if isinstance(event["error"], dict) else {}
            state.errors[f"stream {error.get('code')}"] += 1
            continue
        delta = (event.get("choices") or [{}])[0].get("delta") or {}
        if first is None and delta.get("content"):
            first = time.monotonic() - start
        if disconnect:
            state.disconnected += 1
            return   # leaving the block closes the connection mid-stream
    if not done:
        state.malformed.append("stream ended without [DONE]")
        return
    state.completed += 1
    state.streamed += 1
    state.latencies.append(time.monotonic() - start)
    if first is not None:
        state.ttfts.append(first)


async def client_loop(index: int, client: httpx.AsyncClient, deadline: float, args: argparse.Namespace,
                      state: LoadState) -> None:
    rng = random.Random(f"{args.seed}:{index}")
    await trio.sleep(rng.random() * 0.5)   # do not start all at the same instant
    while time.monotonic() < deadline:
        backoff = await one_request(client, rng, args, state)
        await trio.sleep(min(backoff, max(0.0, deadline - time.monotonic())))


async def watch_health(url: str, state: LoadState, done: trio.Event, pid: int | None) -> None:
    """GET /health every 0.5 s, sampling the server's RSS after each poll."""

    def sample_rss() -> None:
        rss = read_proc_status(pid).get("VmRSS") if pid is not None else None
        if rss:
            state.rss_samples.append(rss)

    await poll_health(url, state.health, done, request_timeout_s=10.0, after_poll=sample_rss)


async def run_load(url: str, args: argparse.Namespace, state: LoadState, pid: int | None) -> None:
    done = trio.Event()
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits) as client:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_health, url, state, done, pid)
            deadline = time.monotonic() + args.seconds
            async with trio.open_nursery() as clients:
                for i in range(args.clients):
                    clients.start_soon(client_loop, i, client, deadline, args, state)
            done.set()


def slots_after(url: str, wait_s: float = 10.0) -> list[dict]:
    """Slots still processing after up to `wait_s` seconds."""
    deadline = time.monotonic() + wait_s
    busy: list[dict] = []
    while True:
        try:
            slots = httpx.get(f"{url}/slots", timeout=5.0).json()
            busy = [s for s in slots if isinstance(s, dict) and s.get("is_processing")]
        except (httpx.HTTPError, ValueError) as exc:
            busy = [{"error": repr(exc)}]
        if not busy or time.monotonic() > deadline:
            return busy
        time.sleep(0.5)


def warm_up(url: str) -> None:
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}], "max_tokens": 2}
    httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300).raise_for_status()


def mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f} MiB"


def ms(value: float | None) -> str:
    return "-" if value is None else f"{1000 * value:.0f} ms"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="an existing server, e.g. http://127.0.0.1:8080")
    where.add_argument("--model", help="start `basert serve MODEL` (ServerProcess) for the run")
    parser.add_argument("--serve-args", default="", help='extra serve flags, e.g. "--continuous-batching 4"')
    parser.add_argument("--pid", type=int, help="the process of --url's server, to read its RSS")
    parser.add_argument("--clients", type=int, default=100, help="concurrent clients (default 100)")
    parser.add_argument("--seconds", type=float, default=60.0, help="how long clients start requests (default 60)")
    parser.add_argument("--max-tokens", type=int, default=8, help="largest max_tokens of a request (default 8)")
    parser.add_argument("--stream-fraction", type=float, default=0.5, help="share of streamed requests (0.5)")
    parser.add_argument("--disconnect-fraction", type=float, default=0.2,
                        help="share of streams the client drops after the first event (0.2)")
    parser.add_argument("--shared-prefix-fraction", type=float, default=0.3,
                        help="share of requests with the common long system prompt (0.3)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a request counts as timed out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()

    with served(args.url, args.model, args.serve_args, None) as (url, process, _):
        pid = process.process.pid if process is not None else args.pid
        warm_up(url)
        before = read_proc_status(pid).get("VmRSS") if pid else None
        state = LoadState()
        began = time.monotonic()
        trio.run(run_load, url, args, state, pid)
        elapsed = time.monotonic() - began
        busy = slots_after(url)
        time.sleep(1.0)
        proc = read_proc_status(pid) if pid else {}
        after, peak = proc.get("VmRSS"), proc.get("VmHWM")
        alive = process is None or process.process.poll() is None

    growth = (after - before) if before is not None and after is not None else None
    result = {
        "url": url, "clients": args.clients, "seconds": args.seconds, "serve_args": args.serve_args,
        "elapsed_s": round(elapsed, 1), "started": state.started, "completed": state.completed,
        "streamed": state.streamed, "disconnected": state.disconnected,
        "errors": dict(state.errors.most_common()),
        "latency_s": {"p50": percentile(state.latencies, 0.5), "p99": percentile(state.latencies, 0.99)},
        "ttft_s": {"p50": percentile(state.ttfts, 0.5), "p99": percentile(state.ttfts, 0.99)},
        "refusals": state.refusals, "refusals_without_retry_after": state.refusals_without_retry_after,
        "malformed": len(state.malformed), "malformed_examples": state.malformed[:10],
        "health": state.health.summary(keep=20),
        "rss_bytes": {"before": before, "peak_hwm": peak, "max_sampled": max(state.rss_samples, default=None),
                      "after": after, "growth": growth},
        "busy_slots_after": busy, "alive": alive,
    }
    failures = []
    if state.malformed:
        failures.append(f"{len(state.malformed)} malformed responses")
    if state.refusals_without_retry_after:
        failures.append(f"{state.refusals_without_retry_after} refusals without Retry-After")
    if state.health.failures:
        failures.append(f"/health over {HEALTH_LIMIT_S:.0f} s or failed {len(state.health.failures)} times")
    if busy:
        failures.append(f"slots still processing after the run: {json.dumps(busy)[:200]}")
    if growth is not None and growth > RSS_GROWTH_LIMIT:
        failures.append(f"RSS grew by {mib(growth)}")
    if not alive:
        failures.append("the server process died")
    result["failures"] = failures

    flags = "an existing server" if args.url else (args.serve_args or "default serve flags")
    print(f"\n{args.clients} clients for {args.seconds:.0f} s against {url} ({flags}); took {elapsed:.1f} s")
    print(f"requests  started {state.started}, completed {state.completed} ({state.streamed} streamed), "
          f"dropped mid-stream by the client {state.disconnected}")
    print("errors    " + (", ".join(f"{k}: {v}" for k, v in state.errors.most_common()) or "none"))
    print(f"latency   p50 {ms(result['latency_s']['p50'])}, p99 {ms(result['latency_s']['p99'])}; "
          f"TTFT p50 {ms(result['ttft_s']['p50'])}, p99 {ms(result['ttft_s']['p99'])}")
    print(f"refusals  {state.refusals} (503/429), without Retry-After {state.refusals_without_retry_after}; "
          f"malformed {len(state.malformed)}")
    print(f"/health   {state.health.polls} polls, max {state.health.max_s:.3f} s, "
          f"{len(state.health.failures)} over {HEALTH_LIMIT_S:.0f} s or failed")
    print(f"RSS       before {mib(before)}, peak {mib(peak)} (VmHWM), after {mib(after)}, "
          f"growth {mib(growth)}" if pid else "RSS       not measured (pass --pid for a --url server)")
    print(f"slots     {'all idle' if not busy else json.dumps(busy)[:300]} after the run")
    for example in state.malformed[:5]:
        print(f"  malformed: {example}")
    print("\nFAILED: " + "; ".join(failures) if failures else "\nOK")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
