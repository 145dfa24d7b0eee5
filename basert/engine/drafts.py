"""Drafts for speculative decoding, without a draft model: the tokens that followed the last few tokens before.

A running request's `Drafter` proposes up to K tokens by matching the last n tokens of its history (n from
`NGRAM_SIZES`, longest first) against

1. the request's own history (prompt and output so far): an index from each n-gram to the position after its
   latest occurrence, extended as the history grows (a dict lookup per size per step, never a scan);
2. the model's `SharedNgrams`: what other requests generated (agents of a fleet repeat each other), a bounded
   table from n-gram to the tokens that followed it, least recently used entries dropped first.

The engine feeds the proposal after the request's next token in one forward and keeps the longest prefix that
the sampler picks itself (`Engine.step`), so a draft only ever changes the speed. K adapts to how the request's
drafts fare: it grows while whole drafts are accepted, shrinks to what was accepted otherwise, and after drafts
that gained nothing the request stops drafting for a number of steps that doubles each time (text that does not
repeat costs at most a rare probe).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

NGRAM_SIZES = (4, 3, 2)          # suffix lengths tried, longest first
DEFAULT_DRAFT_MAX = 8            # most drafted tokens per step (--spec-draft-max)
MAX_DRAFT_MAX = 64
FIRST_DRAFT = 4                  # K of a request's first draft
SHARED_NGRAMS = 1 << 16          # entries of a model's shared table
MAX_BACKOFF = 32                 # most steps a request waits between drafts after drafts that gained nothing


class SharedNgrams:
    """n-gram (of the longest size) -> the tokens that followed it in some request's output, at most `capacity`
    entries, the least recently used dropped first."""

    def __init__(self, draft_max: int, capacity: int = SHARED_NGRAMS):
        self.draft_max = draft_max
        self.capacity = capacity
        self._table: OrderedDict[tuple[int, ...], tuple[int, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    def learn(self, tokens: Sequence[int]) -> None:
        """Remember what followed each n-gram of a finished request's tokens (prompt and output)."""
        n = NGRAM_SIZES[0]
        table = self._table
        for end in range(n, len(tokens)):
            key = tuple(tokens[end - n: end])
            table[key] = tuple(tokens[end: end + self.draft_max])
            table.move_to_end(key)
        while len(table) > self.capacity:
            table.popitem(last=False)

    def follow(self, suffix: tuple[int, ...]) -> tuple[int, ...]:
        """The tokens that followed `suffix` (an n-gram of the longest size) last time, or ()."""
        found = self._table.get(suffix)
        if found is None:
            return ()
        self._table.move_to_end(suffix)
        return found


class Drafter:
    """One request's drafts: a copy of its history with an n-gram index, and its adaptive draft length."""

    __slots__ = ("_after", "_backoff", "_history", "_idle", "_k", "draft_max", "shared")

    def __init__(self, draft_max: int, shared: SharedNgrams | None):
        self.draft_max = draft_max
        self.shared = shared
        self._history: list[int] = []
        self._after: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in NGRAM_SIZES}
        self._k = min(FIRST_DRAFT, draft_max)
        self._backoff = 0          # steps to wait after the last draft that gained nothing (0: none pending)
        self._idle = 0             # steps left before the next draft

    def propose(self, computed: Sequence[int], next_token: int, room: int) -> list[int]:
        """Up to min(K, room) tokens to follow the history: the tokens `computed` so far, then `next_token`.
        Each call's history extends the previous call's."""
        self._extend(computed, next_token)
        if self._idle:
            self._idle -= 1
            return []
        limit = min(self._k, room)
        if limit <= 0:
            return []
        history = self._history
        length = len(history)
        for n in NGRAM_SIZES:
            if length < n:
                continue
            suffix = tuple(history[length - n:])
            at = self._after[n].get(suffix)
            if at is not None:
                return history[at: at + limit]
            if n == NGRAM_SIZES[0] and self.shared is not None:
                found = self.shared.follow(suffix)
                if found:
                    return list(found[:limit])
        return []

    def update(self, drafted: int, accepted: int) -> None:
        """How the last draft fared: `accepted` of its `drafted` tokens were the sampler's own."""
        if drafted == 0:
            return
        if accepted == drafted:
            self._k = min(self.draft_max, 2 * self._k)
            self._backoff = 0
        elif accepted == 0:
            self._k = 1
            self._backoff = min(MAX_BACKOFF, 2 * self._backoff + 1)
            self._idle = self._backoff
        else:
            self._k = max(1, accepted)
            self._backoff = 0

    def _extend(self, computed: Sequence[int], next_token: int) -> None:
        """Append what the history gained since the last call, indexing the n-grams that end before each new
        position: n-gram -> that position (its latest occurrence wins)."""
        history = self._history
        start = len(history)
        history.extend(computed[start:])
        history.append(next_token)
        for at in range(max(start, 1), len(history)):
            for n in NGRAM_SIZES:
                if at >= n:
                    self._after[n][tuple(history[at - n: at])] = at
