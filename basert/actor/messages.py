"""Typed messages into a ModelActor's mailbox. A generation's replies are the engine's own events
(`TokenEvent`, then one `FinishEvent` or `FailEvent`); an admin message's reply is its result or the exception."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import trio

from basert.engine.types import FailEvent, FinishEvent, GenerationRequest, TokenEvent


@dataclass(frozen=True, slots=True)
class Generate:
    request: GenerationRequest
    reply: trio.MemorySendChannel
    slot_hint: int | None = None
    sent_at: float = field(default_factory=trio.current_time)  # a long step may keep it in the mailbox a while


@dataclass(frozen=True, slots=True)
class Cancel:
    request_id: str


@dataclass(frozen=True, slots=True)
class FailGenerations:
    """End every queued and running generation with `error` (a drain that ran out of time)."""

    error: Exception


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


@dataclass(frozen=True, slots=True)
class Embed:
    """Embed token lists (replies with the float32 array [len(token_lists), hidden], or the exception)."""

    token_lists: list[list[int]]
    pooling: str
    reply: trio.MemorySendChannel


Message = (Generate | Cancel | FailGenerations | SlotList | SlotSave | SlotRestore | SlotErase | Stats | CacheSave
           | Embed)


Reply = TokenEvent | FinishEvent | FailEvent
