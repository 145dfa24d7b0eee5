"""What goes into the engine and what comes out: requests, events, and the scheduler's view of a step.

A `GenerationRequest` is admitted into a slot; every `Engine.step` returns events: `TokenEvent` for each
sampled token, then one `FinishEvent` (or a `FailEvent` when the step failed). `SlotStatus` is what the
scheduler sees of a busy slot, and `StepPlan` is what it decides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from basert.engine.sampler import SamplingParams, TokenLogprob


class TokenConstraint(Protocol):
    """A grammar matcher: masks logits, follows the chosen tokens, says which tokens it forces next (the only text it
    allows there, as the tokenizer writes it alone; speculative decoding drafts them) and when the output is
    complete."""

    def apply(self, logits: np.ndarray) -> None: ...
    def consume(self, token_id: int) -> None: ...
    def forced(self) -> list[int]: ...
    @property
    def is_finished(self) -> bool: ...


class OutputStop(Protocol):
    """Says, token by token, whether the output text so far ends the generation."""

    def reached(self, text: str) -> bool: ...


@dataclass(slots=True)
class GenerationRequest:
    """Everything the engine needs to run one completion (one choice)."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    constraint: TokenConstraint | None = None
    ignore_eos: bool = False
    deadline: float | None = None          # time.monotonic() after which generation stops ("length")
    segment_ends: tuple[int, ...] = ()     # prompt positions where a chat segment ends (e.g. the system prompt)
    # Stop ("stop", the text kept) once this says the output text so far is complete: where a chat turn's tool
    # calls end, for example. One per request: it may follow the text as it grows.
    stop_after: OutputStop | None = None
    speculative: bool = True               # drafts may be tried (the output is the same either way) ...
    draft_max: int | None = None           # ... at most this many per step (None: the engine's limit)
    # With context shift: the prompt tokens kept when the context is full (-1: all of them; None: the engine's
    # default), before the oldest half of the rest is dropped.
    n_keep: int | None = None


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class Timings:
    prompt_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0       # from the first generated token to the last: `decode_steps` steps
    ttft_ms: float = 0.0
    draft_n: int = 0                # drafted tokens fed (speculative decoding)
    draft_n_accepted: int = 0       # of those, the ones the sampler picked itself

    @property
    def decode_steps(self) -> int:
        """The decode steps `predicted_ms` covers: the first token comes from the prefill's logits."""
        return max(self.predicted_n - 1, 0)

    def as_dict(self, cache_n: int) -> dict:
        return {
            "cache_n": cache_n,
            "prompt_n": self.prompt_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_second": self.prompt_n / (self.prompt_ms / 1000) if self.prompt_ms > 0 else 0.0,
            "predicted_n": self.predicted_n,
            "predicted_ms": self.predicted_ms,
            "predicted_per_second": 1000 * self.decode_steps / self.predicted_ms if self.predicted_ms > 0 else 0.0,
            "draft_n": self.draft_n,
            "draft_n_accepted": self.draft_n_accepted,
        }


@dataclass(frozen=True, slots=True)
class TokenEvent:
    request_id: str
    token_id: int
    # The text this token releases: its own and that of earlier tokens held back while it could start a stop string
    # (the last token of a generation releases all that is left).
    text: str
    logprob: TokenLogprob | None


@dataclass(frozen=True, slots=True)
class FinishEvent:
    request_id: str
    finish_reason: str              # "stop", "length", or the reason given to Engine.cancel
    text: str                       # text still held back when no token ended it (end of sequence, a cancel)
    usage: Usage
    timings: Timings
    slot: int
    timed_out: bool = False
    stop_word: str = ""             # the stop string that ended the generation, if one did
    truncated: bool = False         # the context shifted: tokens were dropped from the prompt or the history


@dataclass(frozen=True, slots=True)
class FailEvent:
    request_id: str
    error: Exception


Event = TokenEvent | FinishEvent | FailEvent


@dataclass(frozen=True, slots=True)
class SlotStatus:
    """What the scheduler knows of a busy slot."""

    slot: int
    decoding: bool          # feeds one sampled token next
    max_chunk: int          # most tokens the next forward may feed: prompt tokens, or the next token and its drafts
    n_past: int
    n_blocks: int
    order: int              # admission order: lower is older
    waits_for_prefix: bool = False  # an older slot is computing blocks this slot can then adopt from the cache


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step: tokens to feed per slot, and slots to preempt or to finish for lack of KV."""

    chunks: tuple[tuple[int, int], ...] = ()   # (slot, number of tokens)
    preempt: tuple[int, ...] = ()              # drop their KV now; they recompute it when blocks are free
    starve: tuple[int, ...] = ()               # cannot grow even with the whole pool: finish ("length")
