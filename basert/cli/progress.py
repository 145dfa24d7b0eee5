"""A progress bar on stderr: redrawn in place on a terminal, a few plain lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO

QUIET_SECONDS = 1.0


class ProgressBar:
    """Call with (done, total, label); prints at most a few times a second."""

    def __init__(self, title: str, stream: TextIO | None = None, width: int = 30):
        self.title = title
        self.stream = stream or sys.stderr
        self.width = width
        self.interactive = self.stream.isatty()
        self.started = time.monotonic()
        self.last_draw = 0.0
        self.last_percent = -1

    def __call__(self, done: int, total: int, label: str = "") -> None:
        now = time.monotonic()
        finished = total > 0 and done >= total
        percent = int(100 * done / total) if total else 100
        if self.interactive:
            if not finished and now - self.last_draw < 0.1:
                return
            filled = int(self.width * percent / 100)
            bar = "#" * filled + "-" * (self.width - filled)
            line = f"\r{self.title} [{bar}] {percent:3d}% {done}/{total} {label[:40]:<40}"
            self.stream.write(line + ("\n" if finished else ""))
        else:
            # Logs and CI: one line per 10% step, and nothing at all for work that ends within a second.
            if now - self.started < QUIET_SECONDS:
                return
            step = percent // 10 * 10
            if step == self.last_percent and not finished:
                return
            self.last_percent = step
            elapsed = now - self.started
            self.stream.write(f"{self.title}: {percent}% ({done}/{total}) {elapsed:.1f}s\n")
        self.last_draw = now
        self.stream.flush()
