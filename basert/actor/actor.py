"""ModelActor: the one trio task that owns a model's engine.

HTTP handlers send messages to its mailbox and await replies on their own channel. The actor
admits queued requests into free slots, runs `Engine.step` in a worker thread while the event
loop keeps serving, relays the events, and handles admin messages between steps, so nothing
ever races a forward. Embeddings are computed between steps too, one token budget of inputs per
pass of the loop, so a large embedding request never stalls running generations for long. A failing step
fails only the requests in it; the actor keeps running.
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
    Embed,
    FailGenerations,
    Generate,
    Message,
    SlotErase,
    SlotList,
    SlotRestore,
    SlotSave,
    Stats,
)
from basert.engine.embeddings import EmbeddingJob
from basert.engine.engine import Engine
from basert.engine.saved_state import PrefixCacheFileError
from basert.engine.types import Event, FailEvent, FinishEvent, TokenEvent
from basert.errors import InvalidRequestError, NotFoundError, UnavailableError

log = logging.getLogger("basert.actor")


class SlotNotFoundError(NotFoundError, LookupError):
    """No slot with this id."""

    code = "slot_not_found"

    def __init__(self, slot: int, n_slots: int):
        super().__init__(f"slot {slot} not found (this model has slots 0..{n_slots - 1})")
        self.slot = slot


class SlotOutOfRangeError(InvalidRequestError, ValueError):
    """A generation asked for a slot the model does not have, so it could never be admitted."""

    param = "id_slot"

    def __init__(self, slot: int, n_slots: int):
        super().__init__(f"id_slot {slot} is not a slot of this model (slots 0..{n_slots - 1}, or -1 for any)")
        self.slot = slot


class ServerBusyError(UnavailableError, RuntimeError):
    """The model's queue is full: the request was refused without waiting."""

    code = "server_busy"

    def __init__(self, max_queued: int, retry_after: int):
        super().__init__(f"the server is busy: {max_queued} requests are already waiting for this model; retry later")
        self.retry_after = retry_after


class QueueTimeoutError(UnavailableError, RuntimeError):
    """The request waited for a slot longer than the queue allows, and was dropped before it started."""

    code = "queue_timeout"

    def __init__(self, waited: float, retry_after: int):
        super().__init__(f"the request waited {waited:.1f} s for a free slot without starting; retry later")
        self.waited = waited
        self.retry_after = retry_after


@dataclass(slots=True)
class Queued:
    """A generation waiting for a slot, and when it stops waiting."""

    message: Generate
    queued_at: float            # when its handler sent it
    expires_at: float
    missed_a_slot: bool = False  # an admission found no slot for it: only then can it time out waiting for one


@dataclass(slots=True)
class Embedding:
    """An Embed message being computed, a forward at a time."""

    message: Embed
    job: EmbeddingJob


@dataclass(slots=True)
class SlotOperationResult:
    slot: int
    n_tokens: int
    n_bytes: int
    milliseconds: float


class ModelActor:
    """Mailbox + engine of one model. Start `run()` in a nursery; stop it by cancelling that scope."""

    def __init__(self, engine: Engine, *, cache_save_interval: float = 0.0, max_queued: int = 64,
                 queue_timeout: float = 600.0):
        self.engine = engine
        self.info = engine.info
        self.cache_save_interval = cache_save_interval
        self.cache_save_failures = 0
        self.max_queued = max_queued          # generations waiting for a slot; more are refused at once
        self.queue_timeout = queue_timeout    # seconds a generation may wait for a slot
        self.refused = 0
        self.timed_out_in_queue = 0
        self._next_cache_save = math.inf
        self.mailbox, self._inbox = trio.open_memory_channel[Message](math.inf)
        self.waiting: deque[Queued] = deque()
        self.admin: deque[Message] = deque()
        self.embeddings: deque[Embedding] = deque()
        self.replies: dict[str, trio.MemorySendChannel] = {}
        self.slot_requests: dict[int, str] = {}
        self.steps = 0

    # --- the task -----------------------------------------------------------------------------
    @property
    def n_slots(self) -> int:
        return self.info.n_slots

    async def run(self) -> None:
        if self.engine.prefix_cache_file is not None and self.cache_save_interval > 0:
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
                stepped = self.engine.has_work
                if stepped:
                    events = await trio.to_thread.run_sync(self._step)
                    self.steps += 1
                    self._dispatch(events)
                if self.embeddings:
                    await self._embed_next()
                elif not stepped:
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

    def _step(self):
        return self.engine.step(self.engine.plan())

    def _handle(self, message: Message) -> None:
        if isinstance(message, Generate):
            self._enqueue(message)
        elif isinstance(message, Cancel):
            self._cancel(message.request_id)
        elif isinstance(message, FailGenerations):
            self._fail_generations(message.error)
        elif isinstance(message, Embed):
            self._enqueue_embedding(message)
        else:
            self.admin.append(message)

    def _enqueue(self, message: Generate) -> None:
        """Queue a generation, or answer it at once when it can never run or the queue is full."""
        request_id = message.request.request_id
        self.replies[request_id] = message.reply
        hint = message.slot_hint
        if hint is not None and not 0 <= hint < self.n_slots:
            self._reply(request_id, FailEvent(request_id, SlotOutOfRangeError(hint, self.n_slots)), final=True)
            return
        try:
            self.engine.check(message.request)
        except Exception as exc:
            self._reply(request_id, FailEvent(request_id, exc), final=True)
            return
        if len(self.waiting) >= self.max_queued:
            self.refused += 1
            self._reply(request_id, FailEvent(request_id, ServerBusyError(self.max_queued, retry_after=1)),
                        final=True)
            return
        expires_at = message.sent_at + self.queue_timeout
        deadline = message.request.deadline
        if deadline is not None:
            # The request timeout counts from arrival: time spent queued is part of it.
            expires_at = min(expires_at, trio.current_time() + deadline - time.monotonic())
        self.waiting.append(Queued(message, message.sent_at, expires_at))

    def _next_expiry(self) -> float:
        return min((queued.expires_at for queued in self.waiting), default=math.inf)

    def _expire_waiting(self) -> None:
        """Answer queued generations whose wait is over with a 503 (they never started). One that has not had
        its chance at a slot yet (it arrived while a step ran, maybe past its deadline) gets it first."""
        now = trio.current_time()
        if now < self._next_expiry():
            return
        still_waiting: deque[Queued] = deque()
        for queued in self.waiting:
            if queued.missed_a_slot and now >= queued.expires_at:
                self.timed_out_in_queue += 1
                request_id = queued.message.request.request_id
                error = QueueTimeoutError(now - queued.queued_at, retry_after=1)
                self._reply(request_id, FailEvent(request_id, error), final=True)
            else:
                still_waiting.append(queued)
        self.waiting = still_waiting

    def _cancel(self, request_id: str) -> None:
        self.waiting = deque(q for q in self.waiting if q.message.request.request_id != request_id)
        self.engine.cancel(request_id)
        reply = self.replies.pop(request_id, None)
        if reply is not None:
            reply.close()
        self._forget_request(request_id)

    def _fail_generations(self, error: Exception) -> None:
        """End every queued and running generation with `error`: each handler answers it as its API's error (in a
        stream, the error event that ends the body)."""
        self.waiting.clear()
        for request_id in list(self.replies):
            self.engine.cancel(request_id)
            self._reply(request_id, FailEvent(request_id, error), final=True)
            self._forget_request(request_id)

    def _forget_request(self, request_id: str) -> None:
        for slot, rid in list(self.slot_requests.items()):
            if rid == request_id:
                del self.slot_requests[slot]

    def _admit(self) -> None:
        still_waiting: deque[Queued] = deque()
        while self.waiting:
            queued = self.waiting.popleft()
            request = queued.message.request
            slot = self.engine.slot_for(request, queued.message.slot_hint)  # a hint is in range: checked on arrival
            if slot is None:
                queued.missed_a_slot = True
                still_waiting.append(queued)
                continue
            try:
                self.engine.admit(request, slot)
            except Exception as exc:  # a bad request fails alone
                self._reply(request.request_id, FailEvent(request.request_id, exc), final=True)
                continue
            self.slot_requests[slot.index] = request.request_id
        self.waiting = still_waiting

    def _dispatch(self, events) -> None:
        for event in events:
            if isinstance(event, FinishEvent):
                self.slot_requests.pop(event.slot, None)
            elif isinstance(event, FailEvent):
                log.error("request %s failed in a step: %r", event.request_id, event.error)
                self._forget_request(event.request_id)
            self._reply(event.request_id, event, final=not isinstance(event, TokenEvent))

    def _reply(self, request_id: str, event: Event, final: bool = False) -> None:
        channel = self.replies.get(request_id)
        if channel is None:
            return
        try:
            channel.send_nowait(event)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            # The handler is gone (client disconnected): free the slot now.
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
            if slot is not None and 0 <= slot < self.n_slots and self.engine.slots[slot].busy:
                postponed.append(message)  # a save/restore/erase on a busy slot waits for it to be free
                continue
            try:
                result = await self._admin(message)
            except Exception as exc:
                result = exc
            answer(message.reply, result)
        self.admin = postponed

    async def _admin(self, message: Message):
        if isinstance(message, SlotList):
            return self.slot_list()
        if isinstance(message, Stats):
            return self.stats()
        if isinstance(message, CacheSave):
            return await trio.to_thread.run_sync(self.save_prefix_cache)
        if not 0 <= message.slot < self.n_slots:
            raise SlotNotFoundError(message.slot, self.n_slots)
        started = time.perf_counter()
        if isinstance(message, SlotSave):
            saved = await trio.to_thread.run_sync(self.engine.save_slot, message.slot, Path(message.path))
        elif isinstance(message, SlotRestore):
            saved = await trio.to_thread.run_sync(self.engine.restore_slot, message.slot, Path(message.path))
        elif isinstance(message, SlotErase):
            n_tokens = self.engine.erase(message.slot)
            return SlotOperationResult(message.slot, n_tokens, 0, 1000 * (time.perf_counter() - started))
        else:
            raise TypeError(f"unknown admin message {message!r}")
        return SlotOperationResult(message.slot, saved.n_tokens, saved.n_bytes,
                                   1000 * (time.perf_counter() - started))

    # --- embeddings ---------------------------------------------------------------------------
    def _enqueue_embedding(self, message: Embed) -> None:
        """Queue an embedding request, or answer it at once when it can never run or the queue is full."""
        try:
            self.engine.check_embedding(message.token_lists)
        except Exception as exc:
            answer(message.reply, exc)
            return
        if len(self.embeddings) >= self.max_queued:
            self.refused += 1
            answer(message.reply, ServerBusyError(self.max_queued, retry_after=1))
            return
        self.embeddings.append(Embedding(message, self.engine.start_embedding(message.token_lists, message.pooling)))

    async def _embed_next(self) -> None:
        """Run the next forward of the oldest embedding request (a long input takes several, with generation
        steps between them); answer it after its last one (or a failure). A request whose client has gone is
        dropped."""
        job = self.embeddings[0].job
        message = self.embeddings[0].message
        if message.reply.statistics().open_receive_channels == 0:
            self.embeddings.popleft()
            job.close()
            return
        try:
            done = await trio.to_thread.run_sync(job.step)
        except Exception as exc:
            self.embeddings.popleft()
            job.close()
            answer(message.reply, exc)
            return
        if done:
            self.embeddings.popleft()
            answer(message.reply, job.vectors)

    def stats(self) -> dict:
        return {"model": self.info.id, "steps": self.steps, "waiting": len(self.waiting),
                "refused": self.refused, "timed_out_in_queue": self.timed_out_in_queue,
                **self.engine.stats(), "prefix_cache_save_failures": self.cache_save_failures}

    # --- prefix cache file --------------------------------------------------------------------
    def load_prefix_cache(self) -> int:
        """Warm the prefix cache from its file; an unusable file is a warning and a cold start."""
        path = self.engine.prefix_cache_file
        if path is None:
            return 0
        try:
            n = self.engine.load_prefix_cache()
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
        path = self.engine.prefix_cache_file
        if path is None:
            return None
        started = time.perf_counter()
        try:
            n = self.engine.save_prefix_cache()
        except Exception as exc:  # a failed save must never take the server down
            self.cache_save_failures += 1
            log.warning("Prefix cache: could not save to %s: %s", path, exc)
            return None
        log.info("Prefix cache: saved %d blocks to %s in %.0f ms", n, path, 1000 * (time.perf_counter() - started))
        return n

    def close(self) -> None:
        """Release the engine (call after `run` has stopped)."""
        self.engine.close()

    def slot_list(self) -> list[dict]:
        return [{"id": slot.index, "model": self.info.id, "is_processing": slot.busy,
                 "cache_tokens": slot.sequence.n_past, "cache_position": slot.sequence.n_past,
                 "n_ctx": self.info.n_ctx, "request_id": self.slot_requests.get(slot.index),
                 "has_run": slot.busy or slot.last_used > 0}
                for slot in self.engine.slots]


def answer(reply: trio.MemorySendChannel, result: object) -> None:
    """Send an admin or embedding result (or exception) to a handler that may have gone away."""
    try:
        reply.send_nowait(result)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
