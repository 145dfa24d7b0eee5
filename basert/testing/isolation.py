"""The isolation harness: requests sharing a long system prompt, sent one after another and in concurrent groups
to one server, each compared with its answer on a freshly started server (or on a server whose slots were all
erased before it). Used by tools/tool_call_harness.py and tests/test_isolation.py."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx
import trio

from basert.testing.client import reset_state
from basert.testing.launcher import ServerProcess, start_servers, stop_servers

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
    """One request of a run: its answer on the server under test and its reference answer."""

    label: str
    key: str
    answer: str
    fresh: str = ""

    @property
    def same(self) -> bool:
        return self.answer == self.fresh


def request_body(key: str, plain: bool) -> dict:
    """"Call lookup_key with key KEY." under the shared system prompt; a forced tool call unless `plain`."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": f"Call lookup_key with key {key}."}]
    body = {"messages": messages, "temperature": 0, "max_tokens": 48}
    if not plain:
        body.update(tools=[LOOKUP_TOOL], tool_choice="required")
    return body


def answer_of(response: dict) -> str:
    """The tool calls of a chat answer as JSON, or its reasoning and content when it has none."""
    message = response["choices"][0]["message"]
    calls = message.get("tool_calls") or []
    if calls:
        return json.dumps([[c["function"]["name"], c["function"]["arguments"]] for c in calls])
    return json.dumps([message.get("reasoning_content"), message.get("content")])


async def ask(client: httpx.AsyncClient, url: str, key: str, plain: bool) -> str:
    """The answer (`answer_of`) of the server at `url` to the request for `key`."""
    response = await client.post(f"{url}/v1/chat/completions", json=request_body(key, plain), timeout=300)
    response.raise_for_status()
    return answer_of(response.json())


def start_server(model: str, flags: list[str], log_dir: Path, name: str) -> ServerProcess:
    """A server for `model` with `flags`, logging to `log_dir`/`name`.log."""
    return ServerProcess(model, *flags, log_path=log_dir / f"{name}.log")


def group_keys(group: int, size: int, n: int) -> list[str]:
    """The keys of concurrent group `group`: `size` distinct keys of the sequential requests (`seq-0` … `seq-{n-1}`)
    in an order of the group's own, and new keys where the group is larger than `n`. A key asked again, alone
    and among others, has one fresh-server answer for both."""
    span = max(n, size)
    stride = next(step for step in (3, 5, 7, 1) if span % step)   # coprime with span: the keys are distinct
    return [f"seq-{(group + 1 + stride * j) % span}" for j in range(size)]


async def shared_answers(url: str, n: int, concurrency: list[int], plain: bool) -> list[Outcome]:
    """`n` sequential requests to one server, then a group of concurrent requests for each size in `concurrency`
    (keys from `group_keys`)."""
    outcomes: list[Outcome] = []
    async with httpx.AsyncClient() as client:

        async def one(key: str, answers: dict[str, str]) -> None:
            answers[key] = await ask(client, url, key, plain)

        for i in range(n):
            key = f"seq-{i}"
            outcomes.append(Outcome(f"sequential {i + 1}/{n}", key, await ask(client, url, key, plain)))
        for group, size in enumerate(concurrency):
            keys = group_keys(group, size, n)
            answers: dict[str, str] = {}
            async with trio.open_nursery() as nursery:
                for key in keys:
                    nursery.start_soon(one, key, answers)
            outcomes += [Outcome(f"concurrent N={size} #{j + 1}", key, answers[key]) for j, key in enumerate(keys)]
    return outcomes


async def answer_on_fresh_servers(model: str, flags: list[str], outcomes: list[Outcome], plain: bool,
                                  log_dir: Path, together: int = 1) -> None:
    """Each outcome's reference answer: its request alone on a server started for it (one per distinct key: the
    same request has the same answer on a fresh server).

    Servers start and stop `together` at a time (starting and exiting keep about one core busy each); their
    requests run one after another, so no two generations compete for the cores.
    """
    keys = list(dict.fromkeys(outcome.key for outcome in outcomes))
    fresh: dict[str, str] = {}
    for first in range(0, len(keys), together):
        batch = keys[first:first + together]
        starts = [partial(start_server, model, flags, log_dir, f"fresh-{key}") for key in batch]
        servers = await trio.to_thread.run_sync(partial(start_servers, *starts))
        try:
            for server, key in zip(servers, batch):
                # A client per server, closed before the server stops: an idle keep-alive connection would
                # hold up its shutdown.
                async with httpx.AsyncClient() as client:
                    fresh[key] = await ask(client, server.url, key, plain)
        finally:
            await trio.to_thread.run_sync(partial(stop_servers, *servers))
    for outcome in outcomes:
        outcome.fresh = fresh[outcome.key]


async def answer_on_erased_server(url: str, outcomes: list[Outcome], plain: bool) -> None:
    """Each outcome's reference answer from one server whose every slot is erased before the request."""
    async with httpx.AsyncClient() as client:
        for outcome in outcomes:
            await trio.to_thread.run_sync(reset_state, url)
            outcome.fresh = await ask(client, url, outcome.key, plain)


async def run_harness(model: str, flags: list[str], n: int, concurrency: list[int], plain: bool,
                      log_dir: Path, reference_flags: list[str] | None = None) -> list[Outcome]:
    """All outcomes: sequential, then each concurrent group; each compared with a fresh server.

    With `reference_flags`, one reference server (those flags) with its slots erased before each request
    stands in for the fresh servers.
    """
    server = await trio.to_thread.run_sync(start_server, model, flags, log_dir, "shared")
    try:
        outcomes = await shared_answers(server.url, n, concurrency, plain)
    finally:
        server.stop()
    if reference_flags is None:
        await answer_on_fresh_servers(model, flags, outcomes, plain, log_dir)
        return outcomes
    reference = await trio.to_thread.run_sync(start_server, model, reference_flags, log_dir, "reference")
    try:
        await answer_on_erased_server(reference.url, outcomes, plain)
    finally:
        reference.stop()
    return outcomes


def report(outcomes: list[Outcome]) -> str:
    """A markdown table of the outcomes and the count of those equal to their reference."""
    lines = ["| request | key | answer | equals fresh server |", "| --- | --- | --- | :---: |"]
    for o in outcomes:
        lines.append(f"| {o.label} | {o.key} | `{o.answer}` | {'yes' if o.same else 'NO'} |")
    same = sum(o.same for o in outcomes)
    lines.append(f"\n{same}/{len(outcomes)} requests equal their fresh-server answer")
    return "\n".join(lines)
