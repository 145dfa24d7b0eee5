"""Shared-prefix tool-call isolation harness (trio + httpx) against `basert serve`.

    python tools/tool_call_harness.py [MODEL] [-n 8] [--concurrency 2 4] [--serve-flag=--chat-template=FILE ...]

Starts a server, sends N sequential requests "Call lookup_key with key seq-i." (tool lookup_key(key:
string), tool_choice "required", temperature 0), then groups of 2 and 4 concurrent requests with
distinct keys. Each request is then sent alone to a freshly started server; the report says, per
request, the tool call returned and whether it equals the fresh-server answer. With --plain, the
requests are plain chat turns under a shared long system prompt instead (the answer is the text).

With --reference-flags, the answers are compared with one reference server started with those flags
instead (e.g. none: the default single-slot mode), whose slots are all erased before each request, so
every reference answer is computed from an empty server just as on a fresh one.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx
import trio

from basert.server.launcher import ServerProcess

LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup_key",
        "description": "Look up the value stored under a key.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
    },
}
SYSTEM_PROMPT = (
    "You are the operations assistant of a key-value store. Every question is answered by calling the "
    "lookup_key tool with the exact key the user names. Never guess values; never invent keys. "
    "Keys look like seq-N where N is a number. " * 4
)


@dataclass(slots=True)
class Outcome:
    label: str
    key: str
    answer: str
    fresh: str = ""

    @property
    def same(self) -> bool:
        return self.answer == self.fresh


def request_body(key: str, plain: bool) -> dict:
    messages = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": f"Call lookup_key with key {key}."}]
    body = {"messages": messages, "temperature": 0, "max_tokens": 48}
    if not plain:
        body.update(tools=[LOOKUP_TOOL], tool_choice="required")
    return body


def answer_of(response: dict) -> str:
    message = response["choices"][0]["message"]
    calls = message.get("tool_calls") or []
    if calls:
        return json.dumps([[c["function"]["name"], c["function"]["arguments"]] for c in calls])
    return json.dumps([message.get("reasoning_content"), message.get("content")])


async def ask(client: httpx.AsyncClient, url: str, key: str, plain: bool) -> str:
    response = await client.post(f"{url}/v1/chat/completions", json=request_body(key, plain), timeout=300)
    response.raise_for_status()
    return answer_of(response.json())


def start_server(model: str, flags: list[str], log_dir: Path, name: str) -> ServerProcess:
    return ServerProcess(model, *flags, log_path=log_dir / f"{name}.log")


async def run_harness(model: str, flags: list[str], n: int, concurrency: list[int], plain: bool,
                      log_dir: Path, reference_flags: list[str] | None = None) -> list[Outcome]:
    """All outcomes: sequential, then each concurrent group; each compared with a fresh server.

    With `reference_flags`, one reference server (those flags) with its slots erased before each request
    stands in for the fresh servers.
    """
    outcomes: list[Outcome] = []
    server = await trio.to_thread.run_sync(start_server, model, flags, log_dir, "shared")
    try:
        async with httpx.AsyncClient() as client:
            for i in range(n):
                key = f"seq-{i}"
                outcomes.append(Outcome(f"sequential {i + 1}/{n}", key, await ask(client, server.url, key, plain)))
            for group, size in enumerate(concurrency):
                keys = [f"seq-{100 * (group + 1) + j}" for j in range(size)]
                answers: dict[str, str] = {}

                async def one(key: str) -> None:
                    answers[key] = await ask(client, server.url, key, plain)

                async with trio.open_nursery() as nursery:
                    for key in keys:
                        nursery.start_soon(one, key)
                outcomes += [Outcome(f"concurrent N={size} #{j + 1}", key, answers[key]) for j, key in enumerate(keys)]
    finally:
        server.stop()
    if reference_flags is not None:
        await answer_on_erased_server(model, reference_flags, outcomes, plain, log_dir)
        return outcomes
    async with httpx.AsyncClient() as client:
        for index, outcome in enumerate(outcomes):
            fresh = await trio.to_thread.run_sync(start_server, model, flags, log_dir, f"fresh-{index}")
            try:
                outcome.fresh = await ask(client, fresh.url, outcome.key, plain)
            finally:
                fresh.stop()
    return outcomes


async def answer_on_erased_server(model: str, flags: list[str], outcomes: list[Outcome], plain: bool,
                                  log_dir: Path) -> None:
    """Each outcome's reference answer from one server whose every slot is erased before the request."""
    server = await trio.to_thread.run_sync(start_server, model, flags, log_dir, "reference")
    try:
        async with httpx.AsyncClient() as client:
            for outcome in outcomes:
                slots = (await client.get(f"{server.url}/slots")).json()
                for slot in slots:
                    (await client.post(f"{server.url}/slots/{slot['id']}/erase")).raise_for_status()
                outcome.fresh = await ask(client, server.url, outcome.key, plain)
    finally:
        server.stop()


def report(outcomes: list[Outcome]) -> str:
    lines = ["| request | key | answer | equals fresh server |", "| --- | --- | --- | :---: |"]
    for o in outcomes:
        lines.append(f"| {o.label} | {o.key} | `{o.answer}` | {'yes' if o.same else 'NO'} |")
    same = sum(o.same for o in outcomes)
    lines.append(f"\n{same}/{len(outcomes)} requests equal their fresh-server answer")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="smollm2", help=".base file or model id (default smollm2)")
    parser.add_argument("-n", type=int, default=8, help="sequential requests (default 8)")
    parser.add_argument("--concurrency", type=int, nargs="*", default=[2, 4], help="concurrent group sizes")
    parser.add_argument("--plain", action="store_true", help="plain chat with a shared system prompt, no tools")
    parser.add_argument("--serve-flag", action="append", default=[], help="extra flag for basert serve (repeatable)")
    parser.add_argument("--reference-flag", action="append", default=None,
                        help="compare with one reference server started with these flags (repeatable; "
                        "--reference-flag= for none), slots erased before each request, instead of a fresh "
                        "server per request")
    parser.add_argument("--json", type=Path, help="also write the outcomes as JSON here")
    args = parser.parse_args()
    flags = [part for flag in args.serve_flag for part in flag.split("=", 1)]
    reference = None
    if args.reference_flag is not None:
        reference = [part for flag in args.reference_flag if flag for part in flag.split("=", 1)]
    with tempfile.TemporaryDirectory() as tmp:
        outcomes = trio.run(run_harness, args.model, flags, args.n, args.concurrency, args.plain, Path(tmp),
                            reference)
    print(report(outcomes))
    if args.json:
        args.json.write_text(json.dumps([{"label": o.label, "key": o.key, "answer": o.answer, "fresh": o.fresh,
                                          "same": o.same} for o in outcomes], indent=2) + "\n")
    return 0 if all(o.same for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
