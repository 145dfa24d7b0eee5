"""Streaming token ids to text without ever splitting a UTF-8 character across two outputs."""

from __future__ import annotations

import codecs

from basert.tokenizer import Tokenizer

SURROGATE_LEAD = b"\xed"


class IncrementalDetokenizer:
    """Turns one generated token at a time into the text it completes."""

    __slots__ = ("_tokenizer", "_skip_special", "_decoder", "_parts")

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        # "replace" holds back an unfinished character until its last byte arrives, and turns bytes
        # that can no longer start or continue a valid character into U+FFFD at once, so a bad
        # byte never raises and never stalls the stream.
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._parts: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._parts)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        if self._skip_special and token_id in self._tokenizer.special_ids:
            return ""
        piece = self._decoder.decode(self._tokenizer.token_bytes(token_id))
        pending, _ = self._decoder.getstate()
        if pending[:1] == SURROGATE_LEAD and pending[1:2] >= b"\xa0":
            # CPython holds back 0xED 0xA0..0xBF (a UTF-16 surrogate, never valid UTF-8) until
            # the next byte; it cannot complete, so it is replaced now.
            piece += self._decoder.decode(b"", final=True)
        return self._emit(piece)

    def flush(self) -> str:
        """End the stream: bytes still waiting for the rest of their character become U+FFFD."""
        return self._emit(self._decoder.decode(b"", final=True))

    def _emit(self, piece: str) -> str:
        if piece:
            self._parts.append(piece)
        return piece
