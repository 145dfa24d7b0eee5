"""Engine: lanes (slots) that each run one generation request, stepped by one batched forward.

Synchronous and free of I/O: the actor calls `admit`, `cancel` and `step`, and relays the events.
Each lane keeps its token history between requests; the next request on a lane reuses the
longest usable common prefix (attention KV is truncated; a recurrent state can only resume from
an exact extension or from the checkpoint taken just before its last prompt token).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from basert.chat.detokenizer import IncrementalDetokenizer
from basert.engine.runner import ContextOverflowError, ForwardRequest, ModelRunner
from basert.engine.sampler import Sampler, SamplingParams, TokenLogprob
from basert.engine.sequence import RecurrentState, SequenceState
from basert.tokenizer import Tokenizer


class TokenConstraint(Protocol):
    """A grammar matcher: masks logits, follows the chosen tokens, says when the output is complete."""

    def apply(self, logits: np.ndarray) -> None: ...
    def consume(self, token_id: int) -> None: ...
    @property
    def is_finished(self) -> bool: ...


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


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass(slots=True)
class Timings:
    prompt_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    ttft_ms: float = 0.0

    def as_dict(self, cache_n: int) -> dict:
        return {
            "cache_n": cache_n,
            "prompt_n": self.prompt_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_second": self.prompt_n / (self.prompt_ms / 1000) if self.prompt_ms > 0 else 0.0,
            "predicted_n": self.predicted_n,
            "predicted_ms": self.predicted_ms,
            "predicted_per_second": self.predicted_n / (self.predicted_ms / 1000) if self.predicted_ms > 0 else 0.0,
        }


@dataclass(slots=True)
class TokenEvent:
    request_id: str
    token_id: int
    text: str                       # text that is final now (stop strings are held back until resolved)
    logprob: TokenLogprob | None


@dataclass(slots=True)
class FinishEvent:
    request_id: str
    finish_reason: str              # "stop" or "length"
    text: str                       # the remaining text released at the end
    usage: Usage
    timings: Timings
    timed_out: bool = False
    lane: int = 0


@dataclass(slots=True)
class FailEvent:
    request_id: str
    error: Exception


Event = TokenEvent | FinishEvent | FailEvent


@dataclass(slots=True)
class Checkpoint:
    """The recurrent state after the first n_tokens of the lane's history."""

    n_tokens: int
    state: RecurrentState


@dataclass(slots=True)
class ActiveGeneration:
    request: GenerationRequest
    sampler: Sampler
    detokenizer: IncrementalDetokenizer | None
    pending: list[int]              # prompt tokens still to feed
    cached_tokens: int
    generated: list[int] = field(default_factory=list)
    text: str = ""
    released: int = 0               # characters of text already sent
    next_token: int | None = None   # sampled, not yet fed
    started: float = 0.0
    prefill_done: float = 0.0
    first_token_at: float = 0.0


class Lane:
    """A slot: a sequence with its history, and at most one active generation."""

    def __init__(self, index: int, sequence: SequenceState):
        self.index = index
        self.sequence = sequence
        self.active: ActiveGeneration | None = None
        self.checkpoint: Checkpoint | None = None

    @property
    def busy(self) -> bool:
        return self.active is not None


class Engine:
    """Lanes over one ModelRunner; `step()` advances every busy lane by one forward."""

    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer | None, n_lanes: int = 1,
                 prefill_chunk: int = 512):
        self.runner = runner
        self.tokenizer = tokenizer
        self.prefill_chunk = prefill_chunk
        self.lanes = [Lane(i, runner.new_sequence()) for i in range(n_lanes)]
        self.eos_ids = tokenizer.eos_ids if tokenizer is not None else frozenset()

    # --- admission ----------------------------------------------------------------------------
    def free_lane(self, prompt: list[int]) -> Lane | None:
        """The idle lane whose history shares the longest prefix with the prompt."""
        idle = [lane for lane in self.lanes if not lane.busy]
        if not idle:
            return None
        return max(idle, key=lambda lane: (common_prefix(lane.sequence.tokens, prompt), -lane.index))

    def admit(self, request: GenerationRequest, lane: Lane) -> None:
        """Start a request on an idle lane, reusing what the lane already computed."""
        if lane.busy:
            raise RuntimeError(f"lane {lane.index} is busy")
        if not request.prompt:
            raise ValueError("the prompt is empty")
        if len(request.prompt) + 1 > self.runner.max_context:
            raise ContextOverflowError(len(request.prompt), self.runner.max_context)
        reused = self._reuse_prefix(lane, request.prompt)
        detokenizer = IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None
        lane.active = ActiveGeneration(
            request=request,
            sampler=Sampler(request.sampling, self.runner.vocab_size),
            detokenizer=detokenizer,
            pending=list(request.prompt[reused:]),
            cached_tokens=reused,
            started=time.monotonic(),
        )

    def _reuse_prefix(self, lane: Lane, prompt: list[int]) -> int:
        seq = lane.sequence
        common = min(common_prefix(seq.tokens, prompt), len(prompt) - 1)
        if seq.recurrent is None:
            self.runner.rewind(seq, common)
            return common
        if common == seq.n_past:
            return common
        checkpoint = lane.checkpoint
        if checkpoint is not None and checkpoint.n_tokens <= common:
            seq.block_table.truncate(checkpoint.n_tokens, self.runner.pool)
            del seq.tokens[checkpoint.n_tokens:]
            seq.recurrent.copy_from(checkpoint.state)
            return checkpoint.n_tokens
        self.runner.release(seq)
        return 0

    def cancel(self, request_id: str) -> bool:
        """Stop a request; its lane is free at once (what it computed stays a valid prefix)."""
        for lane in self.lanes:
            if lane.active is not None and lane.active.request.request_id == request_id:
                lane.active = None
                return True
        return False

    @property
    def has_work(self) -> bool:
        return any(lane.busy for lane in self.lanes)

    # --- stepping -----------------------------------------------------------------------------
    def step(self) -> list[Event]:
        """One forward over every busy lane (a prefill chunk or one decode token each); the events."""
        work: list[tuple[Lane, list[int], bool]] = []
        for lane in self.lanes:
            gen = lane.active
            if gen is None:
                continue
            if not gen.pending:
                work.append((lane, [gen.next_token], True))
                continue
            hybrid = lane.sequence.recurrent is not None
            if hybrid and len(gen.pending) == 1:
                # The state just before the last prompt token: the next request sharing this prompt resumes here.
                self._checkpoint(lane)
            chunk = gen.pending[: self.prefill_chunk]
            if hybrid and len(chunk) == len(gen.pending) and len(chunk) > 1:
                chunk = chunk[:-1]  # stop one short, so the checkpoint above can be taken next step
            work.append((lane, chunk, len(chunk) == len(gen.pending)))
        if not work:
            return []
        requests = [ForwardRequest(lane.sequence, chunk, "last" if wants else "none")
                    for lane, chunk, wants in work]
        try:
            results = self.runner.forward(requests)
        except Exception as exc:
            return self._fail(work, exc)
        events: list[Event] = []
        now = time.monotonic()
        for (lane, chunk, wants), logits in zip(work, results):
            gen = lane.active
            if gen.pending:
                del gen.pending[: len(chunk)]
                if not wants:
                    continue
                gen.prefill_done = now
            gen.next_token = None
            try:
                events.extend(self._after_logits(lane, gen, logits[0], now))
            except Exception as exc:
                events.extend(self._fail([(lane, chunk, wants)], exc))
        return events

    def _checkpoint(self, lane: Lane) -> None:
        seq = lane.sequence
        if lane.checkpoint is None:
            lane.checkpoint = Checkpoint(seq.n_past, seq.recurrent.clone())
        else:
            lane.checkpoint.state.copy_from(seq.recurrent)
            lane.checkpoint.n_tokens = seq.n_past

    def _after_logits(self, lane: Lane, gen: ActiveGeneration, logits: np.ndarray, now: float) -> list[Event]:
        request = gen.request
        if request.constraint is not None:
            request.constraint.apply(logits)
        token, logprob = gen.sampler.sample(logits, lane.sequence.tokens)
        if not gen.first_token_at:
            gen.first_token_at = now
        events: list[Event] = []
        finish = None
        timed_out = stopped_by_string = False
        if token in self.eos_ids and not request.ignore_eos:
            finish = "stop"
        else:
            if request.constraint is not None:
                request.constraint.consume(token)
            gen.generated.append(token)
            if gen.detokenizer is not None:
                gen.text += gen.detokenizer.push(token)
            if request.constraint is not None and request.constraint.is_finished:
                finish = "stop"
            elif self._hit_stop_string(gen):
                finish, stopped_by_string = "stop", True
            elif len(gen.generated) >= request.max_tokens or lane.sequence.n_past + 1 >= self.runner.max_context:
                finish = "length"
            elif request.deadline is not None and now >= request.deadline:
                finish, timed_out = "length", True
            if finish is None:
                gen.next_token = token
                return [TokenEvent(request.request_id, token, self._releasable(gen), logprob)]
            events.append(TokenEvent(request.request_id, token, "", logprob))
        if gen.detokenizer is not None and not stopped_by_string:
            gen.text += gen.detokenizer.flush()
        tail = gen.text[gen.released:]
        gen.released = len(gen.text)
        prefill_end = gen.prefill_done or now
        timings = Timings(
            prompt_n=len(request.prompt) - gen.cached_tokens,
            prompt_ms=1000 * (prefill_end - gen.started),
            predicted_n=len(gen.generated),
            predicted_ms=1000 * (now - prefill_end),
            ttft_ms=1000 * (gen.first_token_at - gen.started),
        )
        usage = Usage(len(request.prompt), gen.cached_tokens, len(gen.generated))
        lane.active = None
        events.append(FinishEvent(request.request_id, finish, tail, usage, timings, timed_out, lane.index))
        return events

    def _hit_stop_string(self, gen: ActiveGeneration) -> bool:
        for stop in gen.request.stop:
            at = gen.text.find(stop, max(0, gen.released - len(stop)))
            if at >= 0:
                gen.text = gen.text[:at]
                return True
        return False

    def _releasable(self, gen: ActiveGeneration) -> str:
        """Text that can no longer become part of a stop string."""
        hold = 0
        for stop in gen.request.stop:
            for size in range(min(len(stop) - 1, len(gen.text)), 0, -1):
                if gen.text.endswith(stop[:size]):
                    hold = max(hold, size)
                    break
        end = len(gen.text) - hold
        if end <= gen.released:
            return ""
        piece = gen.text[gen.released:end]
        gen.released = end
        return piece

    def _fail(self, work: list[tuple[Lane, list[int], bool]], exc: Exception) -> list[Event]:
        events: list[Event] = []
        for lane, _, _ in work:
            if lane.active is not None:
                events.append(FailEvent(lane.active.request.request_id, exc))
                lane.active = None
            self.runner.release(lane.sequence)
            lane.checkpoint = None
        return events


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
