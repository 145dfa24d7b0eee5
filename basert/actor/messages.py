"""Typed messages into a ModelActor's mailbox, and the reply events sent back to a request's handler."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import trio

from basert.engine.engine import GenerationRequest, Timings, Usage
from basert.engine.sampler import TokenLogprob


@dataclass(frozen=True, slots=True)
class Generate:
    request: GenerationRequest
    reply: trio.MemorySendChannel
    slot_hint: int | None = None


@dataclass(frozen=True, slots=True)
class Cancel:
    request_id: str


@dataclass(frozen=True, slots=True)
class SlotList:
    reply: trio.MemorySendChannel


@dataclass(frozen=True, slots=True)
class SlotSave:
    slot: int
    path: Path
    reply: trio.MemorySendChannel


@dataclass(frozen=True, slots=True)
class SlotRestore:
    slot: int
    path: Path
    reply: trio.MemorySendChannel


@dataclass(frozen=True, slots=True)
class SlotErase:
    slot: int
    reply: trio.MemorySendChannel


@dataclass(frozen=True, slots=True)
class Stats:
    reply: trio.MemorySendChannel


@dataclass(frozen=True, slots=True)
class CacheSave:
    """Write the prefix cache file now (replies with the number of blocks written, or None)."""

    reply: trio.MemorySendChannel


Message = Generate | Cancel | SlotList | SlotSave | SlotRestore | SlotErase | Stats | CacheSave


@dataclass(frozen=True, slots=True)
class Tokens:
    ids: list[int]
    text: str
    logprobs: list[TokenLogprob | None]


@dataclass(frozen=True, slots=True)
class Done:
    finish_reason: str
    text: str
    usage: Usage
    timings: Timings
    slot: int
    timed_out: bool = False


@dataclass(frozen=True, slots=True)
class Failed:
    error: Exception


Reply = Tokens | Done | Failed
