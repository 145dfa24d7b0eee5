"""Drafts for speculative decoding, without a draft model: the tokens that followed the last few tokens before.

A running request's `Drafter` looks for a continuation of its history by matching its last n tokens (n from
`NGRAM_SIZES`, longest first) against

1. the request's own history (prompt and output so far): an index from each n-gram to the position after its
   latest occurrence, extended as the history grows (a dict lookup per size per step, never a scan);
2. the model's `SharedNgrams`: what other requests generated (agents of a fleet repeat each other), a bounded
   table from n-gram to the tokens that followed it, least recently used entries dropped first.
3. where neither offers a draft, the history's text (with the engine's tokenizer): the bytes that followed the
   latest earlier occurrence of the text's last few bytes, tokenized. A value copied into a JSON string starts with
   other tokens than where it stood in prose (`"1487` against ` 1487`), so its token n-grams miss it until several
   of its tokens are out; its text matches after the first.

The engine feeds the draft after the request's next token in one forward and keeps the longest prefix that the
sampler picks itself (`Engine.step`), so a draft only ever changes the speed. How many of the continuation's
tokens to draft (K) is a bet, made each step: a step that feeds K more tokens costs `StepCosts.ratio` times one
that does not (measured on this machine as the engine runs: on a CPU a few more tokens cost little where decode
waits for memory and nearly their share where it computes), and the request's recent acceptance rate `a`
predicts 1 + a + a^2 + ... + a^K tokens from it. The rate depends on how long a match the draft comes from: its source
agrees with the history's last m tokens (m at least the n looked up), and the longer m, the likelier the text goes
on as it did there (a copy in progress, not a common phrase), so acceptance is counted per band of m, each from its
own prior. The drafts of a step's decoding slots are chosen together (`draft_lengths`): the step's cost depends on all
the tokens it feeds, so each drafted token goes where it is likeliest to be accepted, and the step drafts as many as
give the most tokens per unit of cost, none when none gives more than decoding alone. A request that drafts nothing
still probes with its best draft after 4, 8, ... 64 steps without one, so that text which starts repeating is
noticed (text that never repeats pays at most a rare probe).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

NGRAM_SIZES = (4, 3, 2)          # suffix lengths tried, longest first
DEFAULT_DRAFT_MAX = 8            # most drafted tokens per step (--spec-draft-max)
MAX_DRAFT_MAX = 64
SHARED_NGRAMS = 1 << 16          # entries of a model's shared table
# A step's cost per extra token fed, relative to a one-token step, until the engine has measured it.
PRIOR_EXTRA_COST = 0.25
COST_MEMORY = 0.2                # weight of the newest observation in a step cost's running average
ACCEPTANCE_MEMORY = 0.8          # weight of the history in a request's acceptance counts (per draft)
# A draft's source matches the history's last `m` tokens, not just the n-gram looked up; the longer that match, the
# likelier the text goes on as it did. Acceptance is counted per band of m (the bands' lower ends), each with its
# own prior of (accepted, rejected) counts.
MATCH_BANDS = (0, 8, 16)
MATCH_PRIORS = ((1.0, 1.0), (4.0, 1.0), (12.0, 1.0))
# Tokens a grammar forces next (the only text it allows there, as the tokenizer writes it) are a band of their own:
# the model may still write that text in other tokens.
FORCED_BAND = len(MATCH_BANDS)
FORCED_PRIOR = (12.0, 1.0)
# Drafts from the history's text are a band of their own: the text's last TEXT_SUFFIXES bytes (longest first) are
# looked up, and the TEXT_FOLLOW bytes after the match are tokenized.
TEXT_BAND = FORCED_BAND + 1
TEXT_PRIOR = (1.0, 1.0)
TEXT_SUFFIXES = (32, 16, 8, 4)
TEXT_FOLLOW = 64
FIRST_PROBE = 4                  # steps without a draft before the first probe, doubling up to ...
LAST_PROBE = 64


class TextTokenizer(Protocol):
    """What text drafts need of a tokenizer."""

    def token_bytes(self, token_id: int) -> bytes: ...

    def encode(self, text: str, *, add_special: bool = False, parse_special: bool = True) -> list[int]: ...


def band_of(match: int) -> int:
    """The band of MATCH_BANDS a match length falls in."""
    band = 0
    while band + 1 < len(MATCH_BANDS) and match >= MATCH_BANDS[band + 1]:
        band += 1
    return band


def draft_lengths(candidates: Sequence[tuple[float, int]], lanes: int, costs: StepCosts) -> list[int]:
    """How many tokens each candidate drafts in a step of `lanes` decoding slots: candidate i offers at most `most_i`
    tokens, each accepted with chance `rate_i` after the ones before it, so its j-th drafted token adds rate_i ** j
    expected tokens. The step yields `lanes` tokens without drafts; with d drafted tokens in all it costs
    `costs.ratio(lanes + d, lanes)` times as much. For each d the best tokens to draft are the d with the largest
    expected gains (each candidate's gains shrink token by token), taken one at a time; the d kept is the one with
    the most expected tokens per cost, and none (all zeros) when no d gives more than decoding alone."""
    lengths = [0] * len(candidates)
    best, best_gain = list(lengths), 1.0
    gains = [(-rate, index, rate) for index, (rate, most) in enumerate(candidates) if most > 0]
    heapq.heapify(gains)
    expected, drafted = float(lanes), 0
    while gains:
        gain, index, rate = heapq.heappop(gains)
        expected -= gain
        drafted += 1
        lengths[index] += 1
        if lengths[index] < candidates[index][1]:
            heapq.heappush(gains, (gain * rate, index, rate))
        per_cost = expected / lanes / costs.ratio(lanes + drafted, lanes)
        if per_cost > best_gain:
            best, best_gain = list(lengths), per_cost
    return best


class StepCosts:
    """Seconds of a decoding step by the tokens it feeds (running averages), and what feeding more costs.

    A step never costs more for feeding fewer tokens, but the averages of two sizes, each measured at its own
    moments of a machine whose speed varies, can say otherwise: a size is taken to cost the least average of its own
    and of every larger size measured."""

    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}
        self._bounded: dict[int, float] = {}    # each measured size's least average over it and the larger ones

    def observe(self, tokens: int, seconds: float) -> None:
        """A step of decoding slots only fed `tokens` tokens in `seconds`."""
        old = self._seconds.get(tokens)
        self._seconds[tokens] = seconds if old is None else old + COST_MEMORY * (seconds - old)
        least = math.inf
        for size in sorted(self._seconds, reverse=True):
            least = self._bounded[size] = min(least, self._seconds[size])

    def ratio(self, tokens: int, base: int) -> float:
        """Cost of a step of `tokens` tokens over one of `base` tokens (measured once both were seen)."""
        if tokens <= base:
            return 1.0
        bounded = self._bounded
        if tokens in bounded and base in bounded and bounded[base] > 0:
            return max(bounded[tokens] / bounded[base], 1.0)
        return (1 + PRIOR_EXTRA_COST * (tokens - 1)) / (1 + PRIOR_EXTRA_COST * (base - 1))


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
    """One request's drafts: a copy of its history with an n-gram index, and its acceptance rates."""

    __slots__ = ("_after", "_band", "_counts", "_history", "_probe_every", "_since_draft", "_text", "_text_tokens",
                 "costs", "draft_max", "shared", "tokenizer")

    def __init__(self, draft_max: int, shared: SharedNgrams | None, costs: StepCosts | None = None,
                 tokenizer: TextTokenizer | None = None):
        self.draft_max = draft_max
        self.shared = shared
        self.costs = costs if costs is not None else StepCosts()
        self.tokenizer = tokenizer
        self._history: list[int] = []
        self._after: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in NGRAM_SIZES}
        self._text = bytearray()    # the bytes of the history's first _text_tokens tokens
        self._text_tokens = 0
        # Decayed counts of accepted and rejected draft tokens per band of match length, from their priors.
        self._counts = [list(prior) for prior in (*MATCH_PRIORS, FORCED_PRIOR, TEXT_PRIOR)]
        self._band = 0              # the band of the last draft proposed
        self._since_draft = 0       # steps since the last draft
        self._probe_every = FIRST_PROBE

    def acceptance(self, band: int = 0) -> float:
        """The chance that a drafted token is accepted, given that the ones before it were, for a draft whose
        source matches the history over a length in `band` (FORCED_BAND: tokens a grammar forces)."""
        accepted, rejected = self._counts[band]
        return accepted / (accepted + rejected)

    def propose(self, computed: Sequence[int], next_token: int, room: int, lanes: int = 1) -> list[int]:
        """The tokens to draft after the history (the tokens `computed` so far, then `next_token`; each call's
        history extends the previous call's): at most `room`, chosen for a step of `lanes` decoding slots of which
        this is the only one drafting (`draft_lengths` chooses for several)."""
        continuation = self.candidate(computed, next_token, room)
        k = draft_lengths([(self.rate, len(continuation))], lanes, self.costs)[0] if continuation else 0
        return self.settle(continuation, k, lanes)

    def candidate(self, computed: Sequence[int], next_token: int, room: int, forced: Sequence[int] = ()) -> list[int]:
        """The longest draft the history offers (see `propose`), each of its tokens accepted with chance `rate`
        after the ones before it; where a grammar forces the `forced` tokens next and the history offers no draft
        that starts with them, those tokens."""
        self._extend(computed, next_token)
        limit = max(min(room, self.draft_max), 0)
        continuation, match = self._continuation(limit)
        forced = list(forced[:limit])
        if forced and continuation[: len(forced)] != forced:
            continuation, self._band = forced, FORCED_BAND
        elif continuation:
            self._band = band_of(match)
        elif self.tokenizer is not None and limit > 0:
            continuation = self._text_continuation(limit)
            self._band = TEXT_BAND
        return continuation

    @property
    def rate(self) -> float:
        """The acceptance rate of the last candidate's tokens."""
        return self.acceptance(self._band)

    def settle(self, continuation: list[int], k: int, lanes: int) -> list[int]:
        """The draft of a step: the first k tokens of the candidate `continuation`; with k = 0 (no draft pays), none,
        or a probe with the draft length that pays best when one is due."""
        if not continuation:
            return []
        self._since_draft += 1
        if k == 0:
            if self._since_draft < self._probe_every:
                return []
            self._probe_every = min(2 * self._probe_every, LAST_PROBE)
            k = self._best_length(len(continuation), lanes, self.rate)
        self._since_draft = 0
        return continuation[:k]

    def update(self, drafted: int, accepted: int) -> None:
        """How the last draft fared: `accepted` of its `drafted` tokens were the sampler's own."""
        if drafted == 0:
            return
        counts = self._counts[self._band]
        counts[0] = ACCEPTANCE_MEMORY * counts[0] + accepted
        counts[1] = ACCEPTANCE_MEMORY * counts[1] + (accepted < drafted)
        if accepted:
            self._probe_every = FIRST_PROBE

    def _best_length(self, most: int, lanes: int, rate: float) -> int:
        """The draft length from 1 to `most` with the most expected tokens per cost in a step of `lanes` decoding
        slots, when each token is accepted with chance `rate` after the ones before it."""
        best, best_gain, expected, term = 1, 0.0, float(lanes), 1.0
        for k in range(1, most + 1):
            term *= rate
            expected += term
            gain = expected / self.costs.ratio(lanes + k, lanes)
            if gain > best_gain:
                best, best_gain = k, gain
        return best

    def _continuation(self, limit: int) -> tuple[list[int], int]:
        """Up to `limit` tokens that followed the longest matching suffix of the history, and how many of the
        history's last tokens their source matches (at most the last band's start; the looked-up n for a
        continuation from the shared table)."""
        if limit <= 0:
            return [], 0
        history = self._history
        length = len(history)
        for n in NGRAM_SIZES:
            if length < n:
                continue
            suffix = tuple(history[length - n:])
            at = self._after[n].get(suffix)
            if at is not None:
                match = n
                while match < MATCH_BANDS[-1] and match < at and history[at - 1 - match] == history[length - 1 - match]:
                    match += 1
                return history[at: at + limit], match
            if n == NGRAM_SIZES[0] and self.shared is not None:
                found = self.shared.follow(suffix)
                if found:
                    return list(found[:limit]), n
        return [], 0

    def _history_text(self) -> bytearray:
        """The history's bytes, extended with the tokens added since the last call (built only when text drafts are
        looked up)."""
        for token in self._history[self._text_tokens:]:
            self._text += self.tokenizer.token_bytes(token)
        self._text_tokens = len(self._history)
        return self._text

    def _text_continuation(self, limit: int) -> list[int]:
        """Up to `limit` tokens of the text that followed the latest earlier occurrence of the history text's longest
        suffix of TEXT_SUFFIXES bytes that occurred before, or []."""
        text = self._history_text()
        end = len(text)
        for size in TEXT_SUFFIXES:
            if end <= size:
                continue
            at = text.rfind(text[end - size:], 0, end - 1)
            if at >= 0:
                follow = bytes(text[at + size: at + size + TEXT_FOLLOW]).decode("utf-8", errors="ignore")
                return self.tokenizer.encode(follow, parse_special=False)[:limit] if follow else []
        return []

    def _extend(self, computed: Sequence[int], next_token: int) -> None:
        """Append what the history gained since the last call, indexing the n-grams that end before each new
        position: n-gram -> that position (its latest occurrence wins)."""
        history = self._history
        start = len(history)
        if start > len(computed):
            return  # asked again before the step: the history already ends with next_token
        history.extend(computed[start:])
        history.append(next_token)
        for at in range(max(start, 1), len(history)):
            for n in NGRAM_SIZES:
                if at >= n:
                    self._after[n][tuple(history[at - n: at])] = at
