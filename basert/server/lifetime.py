"""How a serving server ends: signals drain it, a second signal or the drain timeout ends what still runs."""

from __future__ import annotations

import logging
import os
import signal

import trio

from basert.actor.messages import FailGenerations
from basert.server.errors import unavailable

log = logging.getLogger("basert.serve")

# How long the requests the server ends when it stops get to send their error (a stream, its last events).
ENDED_ANSWER_SECONDS = 5.0


class ServerLifetime:
    """How a serving server ends: a signal drains it (new requests get 503, running ones get --drain-timeout),
    a second signal or the timeout ends the running requests with a 503, then hypercorn shuts down."""

    def __init__(self, app, guarded, catalog, drain_timeout: float) -> None:
        self.app = app
        self.guarded = guarded
        self.catalog = catalog
        self.drain_timeout = drain_timeout
        self.shutdown = trio.Event()

    async def stop(self) -> None:
        """End the generations still running with a 503, so that every client gets an answer (a stream ends with
        its API's error event and a complete body instead of being cut off), then shut down."""
        error = unavailable("the server is shutting down and stopped this request", "draining", retry_after=5)
        for model in self.catalog.models:
            model.actor.mailbox.send_nowait(FailGenerations(error))
        with trio.move_on_after(ENDED_ANSWER_SECONDS):
            await self.guarded.wait_idle()
        self.shutdown.set()

    async def drain(self) -> None:
        """Refuse new requests with a 503 and give the running ones the drain timeout, then stop."""
        self.app.basert_state.draining = True
        with trio.move_on_after(self.drain_timeout) as waiting:
            await self.guarded.wait_idle()
        if waiting.cancelled_caught:
            log.warning("drain timeout: %d request(s) still running are ended with a 503", self.guarded.in_flight)
        await self.stop()

    async def handle_signals(self, nursery: trio.Nursery, early_signals: list[int]) -> None:
        """Drain on SIGINT/SIGTERM (also one received before serving), stop at once on a second one. The receiver
        stays open until the end, so a second signal cuts the drain short instead of killing the process before
        the caches are saved."""
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            if early_signals:
                log.info("received %s before serving: draining", signal.Signals(early_signals[0]).name)
                nursery.start_soon(self.drain)
            async for signum in signals:
                name = signal.Signals(signum).name
                if self.app.basert_state.draining:
                    log.info("received %s again: ending the running requests and stopping", name)
                    nursery.start_soon(self.stop)
                else:
                    log.info("received %s: draining (new requests get 503; up to %.0f s for running ones)",
                             name, self.drain_timeout)
                    nursery.start_soon(self.drain)

    async def watch_parent(self, nursery: trio.Nursery, parent: int) -> None:
        """Drain when the process that started this one exits."""
        while os.getppid() == parent:
            await trio.sleep(0.5)
        log.info("the parent process %d exited: draining", parent)
        nursery.start_soon(self.drain)
