"""Per-request output handling: generated tokens to text, stop strings, limits, deadline and timings.

The engine samples a token and hands it to the request's `RequestOutput`, which says whether the
generation ends there (and why) and which text is final. Text is released by whole tokens: while the text's end
could still turn out to be the start of a stop string, all the text not handed out yet is held back, and the
token or the end that decides releases it, so every piece is exactly the text of the tokens since the last one.
"""

from __future__ import annotations

import time

from basert.engine.detokenizer import IncrementalDetokenizer
from basert.engine.types import GenerationRequest, Timings, Usage
from basert.tokenizer import Tokenizer


class RequestOutput:
    """The output side of one running request."""

    __slots__ = ("request", "detokenizer", "generated", "text", "released", "cached_tokens", "started",
                 "prefill_started", "prefill_done", "first_token_at", "last_token_at", "timed_out", "stop_word",
                 "prompt_not_computed", "draft_n", "draft_n_accepted", "truncated")

    def __init__(self, request: GenerationRequest, tokenizer: Tokenizer | None, cached_tokens: int):
        self.request = request
        self.detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.generated: list[int] = []
        self.text = ""
        self.released = 0               # characters of text already handed out
        self.cached_tokens = cached_tokens
        self.started = time.monotonic()  # admitted
        self.prefill_started = 0.0       # first prompt chunk fed (after waiting for blocks or a shared prefix)
        self.prefill_done = 0.0
        self.first_token_at = 0.0
        self.last_token_at = 0.0         # the last generated token (not an end-of-sequence) was sampled
        self.timed_out = False
        self.stop_word = ""              # the stop string that ended the generation
        self.prompt_not_computed = 0     # prompt tokens left unfed when the deadline stopped the prefill
        self.draft_n = 0                 # drafted tokens fed (speculative decoding) ...
        self.draft_n_accepted = 0        # ... and accepted
        self.truncated = False           # the context shifted (tokens dropped from the prompt or the history)

    def add(self, token: int, context_full: bool, now: float) -> str | None:
        """Append a generated token (not an end-of-sequence); the finish reason it causes, or None."""
        request = self.request
        self.generated.append(token)
        self.last_token_at = now
        if self.detokenizer is not None:
            self.text += self.detokenizer.push(token)
        if request.constraint is not None and request.constraint.is_finished:
            return "stop"
        if self._hit_stop_string() or (request.stop_after is not None and request.stop_after.reached(self.text)):
            return "stop"
        if len(self.generated) >= request.max_tokens or context_full:
            return "length"
        if self.out_of_time(now):
            return "length"
        return None

    def out_of_time(self, now: float) -> bool:
        """Whether the request's deadline has passed (the generation then ends "length", marked timed out)."""
        if self.request.deadline is None or now < self.request.deadline:
            return False
        self.timed_out = True
        return True

    def releasable(self) -> str:
        """The text not handed out before, or nothing while its end could still be the start of a stop string."""
        for stop in self.request.stop:
            for size in range(min(len(stop) - 1, len(self.text)), 0, -1):
                if self.text.endswith(stop[:size]):
                    return ""
        return self._release(len(self.text))

    def release_rest(self) -> str:
        """The generation has ended: all text not handed out yet, with an unfinished character's bytes as U+FFFD
        (none after a stop string, where the text was cut)."""
        if self.detokenizer is not None and not self.stop_word:
            self.text += self.detokenizer.flush()
        return self._release(len(self.text))

    def close(self, now: float) -> tuple[str, Usage, Timings]:
        """The text still held back (`release_rest`), usage and timings."""
        tail = self.release_rest()
        prompt = self.request.prompt
        prefill_end = self.prefill_done or now
        timings = Timings(
            prompt_n=len(prompt) - self.cached_tokens - self.prompt_not_computed,
            prompt_ms=1000 * (prefill_end - (self.prefill_started or self.started)),
            predicted_n=len(self.generated),
            predicted_ms=1000 * ((self.last_token_at or prefill_end) - prefill_end),
            ttft_ms=1000 * ((self.first_token_at or now) - self.started),
            draft_n=self.draft_n,
            draft_n_accepted=self.draft_n_accepted,
        )
        return tail, Usage(len(prompt), self.cached_tokens, len(self.generated)), timings

    def _release(self, end: int) -> str:
        if end <= self.released:
            return ""
        piece = self.text[self.released:end]
        self.released = end
        return piece

    def _hit_stop_string(self) -> bool:
        for stop in self.request.stop:
            at = self.text.find(stop, max(0, self.released - len(stop)))
            if at >= 0:
                self.text = self.text[:at]
                self.stop_word = stop
                return True
        return False
