"""Logging for the server: client text made safe for one log line (or one field of it), and repeated warnings rate
limited."""

from __future__ import annotations

import logging
import time


def printable(text: str, limit: int = 512) -> str:
    """`text` with control and other non-printable characters escaped, so a client cannot forge log lines."""
    if len(text) > limit:
        text = text[:limit] + "…"
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def log_field(text: str, limit: int = 512) -> str:
    """`text` as one field of a space-separated log line: printable, its spaces written %20, so that client text
    cannot fill the fields after it."""
    return printable(text, limit).replace(" ", "%20")


class RepeatedWarningFilter(logging.Filter):
    """Lets an identical WARNING-or-worse message through once per `interval` seconds.

    The next one let through after a quiet spell says how many were held back, so a failure that
    repeats every few seconds (a cache file that cannot be written) shows up without flooding the log.
    """

    def __init__(self, interval: float = 300.0) -> None:
        super().__init__()
        self.interval = interval
        self._last: dict[tuple[str, str], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or record.exc_info:
            return True
        key = (record.name, record.getMessage())
        now = time.monotonic()
        last, held = self._last.get(key, (-float("inf"), 0))
        if now - last < self.interval:
            self._last[key] = (last, held + 1)
            return False
        if len(self._last) > 10_000:
            self._last.clear()
        self._last[key] = (now, 0)
        if held:
            record.msg = f"{record.getMessage()} (repeated {held} more times in the last {now - last:.0f} s)"
            record.args = ()
        return True
