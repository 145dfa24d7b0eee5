"""ModelActor: the one trio task that owns a model's engine.

HTTP handlers send messages to its mailbox and await replies on their own channel. The actor
admits queued requests into free lanes, runs `Engine.step` in a worker thread while the event
loop keeps serving, relays the events, and handles admin messages between steps, so nothing
ever races a forward. A failing step fails only the requests in it; the actor keeps running.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import trio

from basert.actor.messages import (
    CacheSave,
    Cancel,
    Done,
    Failed,
    Generate,
    Message,
    SlotErase,
    SlotList,
    SlotRestore,
    SlotSave,
    Stats,
    Tokens,
)
from basert.actor.scheduler import DEFAULT_TOKEN_BUDGET, plan_step
from basert.engine.engine import Engine, FailEvent, FinishEvent, TokenEvent
from basert.engine.prefix_store import PrefixCacheFileError, load_prefix_cache, save_prefix_cache
from basert.engine.snapshot import restore_lane, save_lane

log = logging.getLogger("basert.actor")


class SlotNotFoundError(LookupError):
    """No lane with this id."""

    def __init__(self, slot: int, n_slots: int):
        super().__init__(f"slot {slot} not found (this model has slots 0..{n_slots - 1})")
        self.slot = slot


class SlotOutOfRangeError(ValueError):
    """A generation asked for a slot the model does not have, so it could never be admitted."""

    def __init__(self, slot: int, n_slots: int):
        super().__init__(f"id_slot {slot} is not a slot of this model (slots 0..{n_slots - 1}, or -1 for any)")
        self.slot = slot


class ServerBusyError(RuntimeError):
    """The model's queue is full: the request was refused without waiting."""

    def __init__(self, max_queued: int, retry_after: int):
        super().__init__(f"the server is busy: {max_queued} requests are already waiting for this model; retry later")
        self.retry_after = retry_after


class QueueTimeoutError(RuntimeError):
    """The request waited for a slot longer than the queue allows, and was dropped before it started."""

    def __init__(self, waited: float, retry_after: int):
        super().__init__(f"the request waited {waited:.0f} s for a free slot without starting; retry later")
        self.retry_after = retry_after


@dataclass(slots=True)
class Queued:
    """A generation waiting for a lane, and when it stops waiting."""

    message: Generate
    queued_at: float
    expires_at: float


@dataclass(slots=True)
class SlotOperationResult:
    slot: int
    n_tokens: int
    n_bytes: int
    milliseconds: float


class ModelActor:
    """Mailbox + engine of one model. Start `run()` in a nursery; stop it by cancelling that scope."""

    def __init__(self, model_id: str, engine: Engine, *, max_running: int = 1,
                 token_budget: int = DEFAULT_TOKEN_BUDGET, cache_file: Path | None = None,
                 cache_save_interval: float = 0.0, max_queued: int = 64, queue_timeout: float = 600.0):
        self.model_id = model_id
        self.engine = engine
        self.max_running = max_running        # lanes generating at once (continuous batching: all of them)
        self.token_budget = token_budget
        self.cache_file = cache_file
        self.cache_save_interval = cache_save_interval
        self.cache_save_failures = 0
        self.max_queued = max_queued          # generations waiting for a lane; more are refused at once
        self.queue_timeout = queue_timeout    # seconds a generation may wait for a lane
        self.refused = 0
        self.timed_out_in_queue = 0
        self._next_cache_save = math.inf
        self.mailbox, self._inbox = trio.open_memory_channel[Message](math.inf)
        self.waiting: deque[Queued] = deque()
        self.admin: deque[Message] = deque()
        self.replies: dict[str, trio.MemorySendChannel] = {}
        self.lane_requests: dict[int, str] = {}
        self.steps = 0

    # --- the task -----------------------------------------------------------------------------
    @property
    def n_slots(self) -> int:
        return len(self.engine.lanes)

    async def run(self) -> None:
        if self.cache_file is not None and self.cache_save_interval > 0:
            self._next_cache_save = trio.current_time() + self.cache_save_interval
        async with self._inbox:
            while True:
                while True:
                    try:
                        self._handle(self._inbox.receive_nowait())
                    except trio.WouldBlock:
                        break
                self._expire_waiting()
                await self._run_admin()
                self._admit()
                if self.engine.has_work:
                    plan = plan_step(self.engine.prepare_step(), self.engine.available_blocks(), self.token_budget)
                    events = await trio.to_thread.run_sync(self.engine.step, plan)
                    self.steps += 1
                    self._dispatch(events)
                else:
                    # Every pass without a step waits for something (a message, a queue deadline, the
                    # cache save, or a moment for a busy slot's admin work), so the loop never spins.
                    wake = min(self._next_cache_save, self._next_expiry())
                    if self.admin:
                        wake = min(wake, trio.current_time() + 0.001)
                    with trio.move_on_at(wake):
                        self._handle(await self._inbox.receive())
                if trio.current_time() >= self._next_cache_save:
                    await trio.to_thread.run_sync(self.save_prefix_cache)
                    self._next_cache_save = trio.current_time() + self.cache_save_interval

    def _handle(self, message: Message) -> None:
        if isinstance(message, Generate):
            self._enqueue(message)
        elif isinstance(message, Cancel):
            self._cancel(message.request_id)
        else:
            self.admin.append(message)

    def _enqueue(self, message: Generate) -> None:
        """Queue a generation, or answer it at once when it can never run or the queue is full."""
        request_id = message.request.request_id
        self.replies[request_id] = message.reply
        hint = message.slot_hint
        if hint is not None and not 0 <= hint < self.n_slots:
            self._reply(request_id, Failed(SlotOutOfRangeError(hint, self.n_slots)), final=True)
            return
        if len(self.waiting) >= self.max_queued:
            self.refused += 1
            self._reply(request_id, Failed(ServerBusyError(self.max_queued, retry_after=1)), final=True)
            return
        now = trio.current_time()
        expires_at = now + self.queue_timeout
        deadline = message.request.deadline
        if deadline is not None:
            # The request timeout counts from arrival: time spent queued is part of it.
            expires_at = min(expires_at, now + max(0.0, deadline - time.monotonic()))
        self.waiting.append(Queued(message, now, expires_at))

    def _next_expiry(self) -> float:
        return min((queued.expires_at for queued in self.waiting), default=math.inf)

    def _expire_waiting(self) -> None:
        """Answer queued generations whose wait is over with a 503 (they never started)."""
        now = trio.current_time()
        if now < self._next_expiry():
            return
        still_waiting: deque[Queued] = deque()
        for queued in self.waiting:
            if now >= queued.expires_at:
                self.timed_out_in_queue += 1
                error = QueueTimeoutError(now - queued.queued_at, retry_after=1)
                self._reply(queued.message.request.request_id, Failed(error), final=True)
            else:
                still_waiting.append(queued)
        self.waiting = still_waiting

    def _cancel(self, request_id: str) -> None:
        self.waiting = deque(q for q in self.waiting if q.message.request.request_id != request_id)
        self.engine.cancel(request_id)
        reply = self.replies.pop(request_id, None)
        if reply is not None:
            reply.close()
        for lane, rid in list(self.lane_requests.items()):
            if rid == request_id:
                del self.lane_requests[lane]

    def _admit(self) -> None:
        still_waiting: deque[Queued] = deque()
        running = sum(lane.busy for lane in self.engine.lanes)
        while self.waiting:
            queued = self.waiting.popleft()
            if running >= self.max_running:
                still_waiting.append(queued)
                continue
            message = queued.message
            request = message.request
            if message.slot_hint is not None:
                lane = self.engine.lanes[message.slot_hint]  # in range: checked on arrival
                lane = None if lane.busy else lane
            else:
                lane = self.engine.free_lane(request.prompt)
            if lane is None:
                still_waiting.append(queued)
                continue
            try:
                self.engine.admit(request, lane)
            except Exception as exc:  # a bad request fails alone
                self._reply(request.request_id, Failed(exc), final=True)
                continue
            self.lane_requests[lane.index] = request.request_id
            running += 1
        self.waiting = still_waiting

    def _dispatch(self, events) -> None:
        for event in events:
            if isinstance(event, TokenEvent):
                self._reply(event.request_id, Tokens([event.token_id], event.text, [event.logprob]))
            elif isinstance(event, FinishEvent):
                self.lane_requests.pop(event.lane, None)
                self._reply(event.request_id, Done(event.finish_reason, event.text, event.usage, event.timings,
                                                   event.lane, event.timed_out), final=True)
            elif isinstance(event, FailEvent):
                log.error("request %s failed in a step: %r", event.request_id, event.error)
                for lane, rid in list(self.lane_requests.items()):
                    if rid == event.request_id:
                        del self.lane_requests[lane]
                self._reply(event.request_id, Failed(event.error), final=True)

    def _reply(self, request_id: str, reply, final: bool = False) -> None:
        channel = self.replies.get(request_id)
        if channel is None:
            return
        try:
            channel.send_nowait(reply)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            # The handler is gone (client disconnected): free the lane now.
            self._cancel(request_id)
            return
        if final:
            self.replies.pop(request_id, None)
            channel.close()

    # --- admin --------------------------------------------------------------------------------
    async def _run_admin(self) -> None:
        postponed: deque[Message] = deque()
        while self.admin:
            message = self.admin.popleft()
            slot = getattr(message, "slot", None)
            if slot is not None and 0 <= slot < len(self.engine.lanes) and self.engine.lanes[slot].busy:
                postponed.append(message)  # a save/restore/erase on a busy slot waits for it to be free
                continue
            try:
                result = await self._admin(message)
            except Exception as exc:
                result = exc
            try:
                message.reply.send_nowait(result)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        self.admin = postponed

    def _lane(self, slot: int):
        if not 0 <= slot < len(self.engine.lanes):
            raise SlotNotFoundError(slot, len(self.engine.lanes))
        return self.engine.lanes[slot]

    async def _admin(self, message: Message):
        if isinstance(message, SlotList):
            return self.slot_list()
        if isinstance(message, Stats):
            return self.stats()
        if isinstance(message, CacheSave):
            return await trio.to_thread.run_sync(self.save_prefix_cache)
        lane = self._lane(message.slot)
        started = time.perf_counter()
        runner = self.engine.runner
        if isinstance(message, SlotSave):
            info = await trio.to_thread.run_sync(save_lane, runner, lane, Path(message.path))
        elif isinstance(message, SlotRestore):
            try:
                info = await trio.to_thread.run_sync(restore_lane, self.engine, lane, Path(message.path))
            except Exception:
                # A refused snapshot leaves the slot empty, never half-restored or stale.
                lane.forget(runner)
                raise
        elif isinstance(message, SlotErase):
            n = lane.sequence.n_past
            lane.forget(runner)
            return SlotOperationResult(message.slot, n, 0, 1000 * (time.perf_counter() - started))
        else:
            raise TypeError(f"unknown admin message {message!r}")
        return SlotOperationResult(message.slot, info.n_tokens, info.n_bytes, 1000 * (time.perf_counter() - started))

    def stats(self) -> dict:
        pool = self.engine.runner.pool
        cache = self.engine.prefix_cache
        return {"model": self.model_id, "steps": self.steps, "waiting": len(self.waiting),
                "refused": self.refused, "timed_out_in_queue": self.timed_out_in_queue,
                "busy_slots": sum(lane.busy for lane in self.engine.lanes),
                "kv_blocks_total": pool.n_blocks, "kv_blocks_used": pool.n_used,
                "prefix_cache": cache.stats() if cache is not None else None,
                "prefix_cache_save_failures": self.cache_save_failures}

    # --- prefix cache file --------------------------------------------------------------------
    def load_prefix_cache(self) -> int:
        """Warm the prefix cache from its file; an unusable file is a warning and a cold start."""
        cache, path = self.engine.prefix_cache, self.cache_file
        if cache is None or path is None:
            return 0
        try:
            n = load_prefix_cache(self.engine.runner, cache, path)
        except FileNotFoundError:
            log.info("Prefix cache: no file at %s yet, starting cold", path)
            return 0
        except (OSError, PrefixCacheFileError) as exc:
            log.warning("Prefix cache: ignoring %s (%s); starting cold", path, exc)
            return 0
        log.info("Prefix cache: warmed %d blocks from %s", n, path)
        return n

    def save_prefix_cache(self) -> int | None:
        """Write the prefix cache file; a failure is a WARNING and counted, never raised. Blocks written."""
        cache, path = self.engine.prefix_cache, self.cache_file
        if cache is None or path is None:
            return None
        started = time.perf_counter()
        try:
            n = save_prefix_cache(self.engine.runner, cache, path)
        except Exception as exc:  # a failed save must never take the server down
            self.cache_save_failures += 1
            log.warning("Prefix cache: could not save to %s: %s", path, exc)
            return None
        log.info("Prefix cache: saved %d blocks to %s in %.0f ms", n, path, 1000 * (time.perf_counter() - started))
        return n

    def slot_list(self) -> list[dict]:
        rows = []
        for lane in self.engine.lanes:
            rows.append({
                "id": lane.index,
                "model": self.model_id,
                "is_processing": lane.busy,
                "cache_tokens": lane.sequence.n_past,
                "cache_position": lane.sequence.n_past,
                "n_ctx": self.engine.runner.max_context,
                "request_id": self.lane_requests.get(lane.index),
            })
        return rows
