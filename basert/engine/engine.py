"""Engine: lanes (slots) that each run one generation request, advanced together by one batched forward.

Synchronous and free of I/O: the actor calls `admit`, `cancel` and `step(plan)` (its scheduler decides the
plan from `prepare_step()`), and relays the events. Each lane keeps its token history between requests
until the KV pool needs the blocks back; a new request reuses the longest usable prefix, either the lane's
own history (attention KV is truncated; a recurrent state resumes only from an exact extension or from the
checkpoints taken at chat-segment ends and just before the last prompt token) or a prefix-cache hit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from basert.chat.detokenizer import IncrementalDetokenizer
from basert.engine.kv import BLOCK_SIZE, blocks_for
from basert.engine.prefix_cache import ROOT_KEY, CacheHit, PrefixCache
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
    segment_ends: tuple[int, ...] = ()     # prompt positions where a chat segment ends (e.g. the system prompt)


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


MAX_LANE_CHECKPOINTS = 4


class KVCacheTooSmallError(ValueError):
    """A prompt needs more KV blocks than the whole pool holds."""


@dataclass(frozen=True, slots=True)
class LaneStatus:
    """What the scheduler knows of a busy lane."""

    lane: int
    decoding: bool          # feeds one sampled token next
    max_chunk: int          # most prompt tokens the next forward may feed (0 while decoding)
    n_past: int
    n_blocks: int
    order: int              # admission order: lower is older
    waits_for_prefix: bool = False  # an older lane is computing blocks this lane can then adopt from the cache


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step: tokens to feed per lane, and lanes to preempt or to finish for lack of KV."""

    chunks: tuple[tuple[int, int], ...] = ()   # (lane, number of tokens)
    preempt: tuple[int, ...] = ()              # drop their KV now; they recompute it when blocks are free
    starve: tuple[int, ...] = ()               # cannot grow even with the whole pool: finish ("length")


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
    pending: list[int]              # tokens still to feed before decoding (prompt, or history after preemption)
    cached_tokens: int
    order: int
    stops: list[int] = field(default_factory=list)  # positions where the recurrent state is captured, ascending
    cache_version: int = -1         # prefix-cache version this lane last looked up
    generated: list[int] = field(default_factory=list)
    text: str = ""
    released: int = 0               # characters of text already sent
    next_token: int | None = None   # sampled, not yet fed
    started: float = 0.0            # admitted
    prefill_started: float = 0.0    # first prompt chunk fed (after waiting for blocks or a shared prefix)
    prefill_done: float = 0.0
    first_token_at: float = 0.0


class Lane:
    """A slot: a sequence with its history, and at most one active generation."""

    def __init__(self, index: int, sequence: SequenceState):
        self.index = index
        self.sequence = sequence
        self.active: ActiveGeneration | None = None
        self.checkpoints: list[Checkpoint] = []   # hybrids: states at earlier points of the history, ascending
        self.last_used = 0

    @property
    def busy(self) -> bool:
        return self.active is not None

    def forget(self, runner: ModelRunner) -> None:
        """Drop the history: blocks back to the pool (cached ones stay findable), state zeroed."""
        runner.release(self.sequence)
        self.checkpoints.clear()

    def keep_checkpoint(self, n_tokens: int, state: RecurrentState) -> None:
        """Remember the state after n_tokens (at most MAX_LANE_CHECKPOINTS; the first one, usually the
        system prompt's end, is kept longest)."""
        self.checkpoints = [c for c in self.checkpoints if c.n_tokens != n_tokens]
        self.checkpoints.append(Checkpoint(n_tokens, state.clone()))
        self.checkpoints.sort(key=lambda c: c.n_tokens)
        if len(self.checkpoints) > MAX_LANE_CHECKPOINTS:
            del self.checkpoints[1]


class Engine:
    """Lanes over one ModelRunner, optionally sharing a prefix cache; `step(plan)` runs one batched forward."""

    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer | None, n_lanes: int = 1,
                 prefix_cache: PrefixCache | None = None):
        self.runner = runner
        self.tokenizer = tokenizer
        self.prefix_cache = prefix_cache
        self.lanes = [Lane(i, runner.new_sequence()) for i in range(n_lanes)]
        self.eos_ids = tokenizer.eos_ids if tokenizer is not None else frozenset()
        self.hybrid = runner.n_linear_layers > 0
        self._admissions = 0
        self._uses = 0

    # --- admission ----------------------------------------------------------------------------
    def free_lane(self, prompt: list[int]) -> Lane | None:
        """The idle lane whose history shares the longest prefix with the prompt."""
        idle = [lane for lane in self.lanes if not lane.busy]
        if not idle:
            return None
        return max(idle, key=lambda lane: (common_prefix(lane.sequence.tokens, prompt), -lane.index))

    def admit(self, request: GenerationRequest, lane: Lane) -> None:
        """Start a request on an idle lane, reusing what the lane or the prefix cache already computed."""
        if lane.busy:
            raise RuntimeError(f"lane {lane.index} is busy")
        if not request.prompt:
            raise ValueError("the prompt is empty")
        if len(request.prompt) + 1 > self.runner.max_context:
            raise ContextOverflowError(len(request.prompt), self.runner.max_context)
        if blocks_for(len(request.prompt) + 1) > self.runner.pool.n_blocks:
            raise KVCacheTooSmallError(
                f"the prompt ({len(request.prompt)} tokens) does not fit in the KV cache "
                f"({self.runner.pool.n_blocks * BLOCK_SIZE} tokens)")
        reused = self._reuse_prefix(lane, request.prompt)
        detokenizer = IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None
        self._admissions += 1
        lane.active = ActiveGeneration(
            request=request,
            sampler=Sampler(request.sampling, self.runner.vocab_size),
            detokenizer=detokenizer,
            pending=list(request.prompt[reused:]),
            cached_tokens=reused,
            order=self._admissions,
            stops=self._stops(request, reused),
            cache_version=self.prefix_cache.version if self.prefix_cache is not None else -1,
            started=time.monotonic(),
        )

    def _stops(self, request: GenerationRequest, reused: int) -> list[int]:
        """Where a hybrid's prefill pauses to capture its recurrent state."""
        if not self.hybrid:
            return []
        n = len(request.prompt)
        stops = set(self._lane_checkpoints_at(request))
        if self.prefix_cache is not None:
            aligned = [(p // BLOCK_SIZE) * BLOCK_SIZE for p in (*request.segment_ends, n, n - 1)]
            stops.update(p for p in aligned if 0 < p <= n)
        return sorted(p for p in stops if p > reused)

    @staticmethod
    def _lane_checkpoints_at(request: GenerationRequest) -> set[int]:
        """Where a hybrid lane keeps its own checkpoints: segment ends (the next turn of a conversation
        shares them) and just before the last prompt token (a resent prompt resumes there)."""
        n = len(request.prompt)
        return {p for p in request.segment_ends if 0 < p < n} | {n - 1}

    def _reuse_prefix(self, lane: Lane, prompt: list[int]) -> int:
        """Prepare the lane's sequence to continue after the longest reusable prefix; its length."""
        limit = len(prompt) - 1  # the last prompt token is always computed, for its logits
        own = self._own_reusable(lane, prompt, limit)
        cache = self.prefix_cache
        hit = cache.lookup(prompt, limit) if cache is not None else None
        if hit is not None and hit.n_tokens > own:
            self._adopt_hit(lane, prompt, hit)
            cache.count_hit(hit.n_tokens)
            return hit.n_tokens
        self._resume_own(lane, own)
        if cache is not None:
            cache.count_hit(own)
        return own

    def _adopt_hit(self, lane: Lane, prompt: list[int], hit: CacheHit) -> None:
        """Replace the lane's history with a prefix-cache hit."""
        seq = lane.sequence
        lane.forget(self.runner)
        seq.block_table.adopt(hit.blocks, self.runner.pool)
        seq.tokens.extend(prompt[: hit.n_tokens])
        seq.block_keys.extend(hit.keys)
        if seq.recurrent is not None:
            seq.recurrent.copy_from(hit.snapshot)

    def _catch_up(self, lane: Lane, gen: ActiveGeneration) -> None:
        """A lane still prefilling its prompt adopts what other lanes cached since it was admitted.

        The scheduler gives the prefill budget to the oldest request first, so of several concurrent
        requests with a common prefix one computes it and the others then start from its blocks.
        """
        cache = self.prefix_cache
        if gen.cache_version == cache.version or gen.next_token is not None or gen.generated:
            return
        gen.cache_version = cache.version
        prompt = gen.request.prompt
        hit = cache.lookup(prompt, len(prompt) - 1, count=False)
        if hit.n_tokens <= lane.sequence.n_past:
            return
        self._adopt_hit(lane, prompt, hit)
        cache.count_hit(hit.n_tokens - gen.cached_tokens)
        gen.cached_tokens = hit.n_tokens
        gen.pending = list(prompt[hit.n_tokens:])
        gen.stops = self._stops(gen.request, hit.n_tokens)

    def _own_reusable(self, lane: Lane, prompt: list[int], limit: int) -> int:
        seq = lane.sequence
        common = min(common_prefix(seq.tokens, prompt), limit)
        if seq.recurrent is None or common == seq.n_past:
            return common
        usable = [c.n_tokens for c in lane.checkpoints if c.n_tokens <= common]
        return max(usable, default=0)

    def _resume_own(self, lane: Lane, n_tokens: int) -> None:
        seq = lane.sequence
        if n_tokens == seq.n_past:
            return
        if n_tokens == 0:
            lane.forget(self.runner)
            return
        if seq.recurrent is not None:
            # _own_reusable only resumes at a checkpoint; later ones belong to the abandoned history.
            lane.checkpoints = [c for c in lane.checkpoints if c.n_tokens <= n_tokens]
            seq.recurrent.copy_from(lane.checkpoints[-1].state)
        self.runner.truncate_kv(seq, n_tokens)

    def cancel(self, request_id: str) -> bool:
        """Stop a request; its lane is free at once (what it computed stays a valid prefix)."""
        for lane in self.lanes:
            if lane.active is not None and lane.active.request.request_id == request_id:
                self._retire(lane)
                return True
        return False

    def _retire(self, lane: Lane) -> None:
        lane.active = None
        self._uses += 1
        lane.last_used = self._uses

    @property
    def has_work(self) -> bool:
        return any(lane.busy for lane in self.lanes)

    # --- planning inputs ----------------------------------------------------------------------
    def prepare_step(self) -> list[LaneStatus]:
        """Let prefilling lanes catch up with the prefix cache, then report every busy lane for planning."""
        statuses = []
        for lane in self.lanes:
            gen = lane.active
            if gen is None:
                continue
            if gen.pending and self.prefix_cache is not None:
                self._catch_up(lane, gen)
            seq = lane.sequence
            max_chunk = 0
            if gen.pending:
                max_chunk = len(gen.pending)
                for stop in gen.stops:
                    if stop > seq.n_past:
                        max_chunk = min(max_chunk, stop - seq.n_past)
                        break
            statuses.append(LaneStatus(lane.index, not gen.pending, max_chunk, seq.n_past,
                                       seq.block_table.n_blocks, gen.order, self._waits_for_prefix(lane)))
        return statuses

    def _waits_for_prefix(self, lane: Lane) -> bool:
        """Whether an older lane still prefilling will cache blocks of this lane's prompt it has not computed."""
        gen = lane.active
        if self.prefix_cache is None or not gen.pending or gen.generated:
            return False
        prompt = gen.request.prompt
        for other in self.lanes:
            leader = other.active
            if leader is None or leader.order > gen.order or other is lane or not leader.pending:
                continue
            shared = common_prefix(leader.request.prompt, prompt)
            if (shared // BLOCK_SIZE) * BLOCK_SIZE > lane.sequence.n_past and other.sequence.n_past < shared:
                return True
        return False

    def available_blocks(self) -> int:
        """Blocks a step can use: free, evictable from the cache, held only by idle lanes' histories, or
        charged for prefix-cache snapshots."""
        pool = self.runner.pool
        idle_only = sum(int(np.count_nonzero(pool.ref_counts[lane.sequence.block_table.view()] == 1))
                        for lane in self.lanes if not lane.busy)
        snapshots = self.prefix_cache.snapshot_blocks if self.prefix_cache is not None else 0
        return pool.n_available + idle_only + snapshots

    # --- stepping -----------------------------------------------------------------------------
    def step(self, plan: StepPlan) -> list[Event]:
        """Carry out one plan: finish starved lanes, preempt, then one forward over the planned chunks."""
        events: list[Event] = []
        for index in plan.starve:
            lane = self.lanes[index]
            if lane.active is not None:
                events.extend(self._finish(lane, lane.active, "length", time.monotonic()))
        for index in plan.preempt:
            self._preempt(self.lanes[index])
        work: list[tuple[Lane, list[int], bool]] = []
        for index, n_tokens in plan.chunks:
            lane = self.lanes[index]
            gen = lane.active
            if gen is None:
                continue
            if not gen.pending:
                work.append((lane, [gen.next_token], True))
                continue
            chunk = gen.pending[:n_tokens]
            last = len(chunk) == len(gen.pending)
            work.append((lane, chunk, last and gen.next_token is None))
        if not work:
            return events
        self.make_room(sum(blocks_for(lane.sequence.n_past + len(chunk)) - lane.sequence.block_table.n_blocks
                            for lane, chunk, _ in work))
        requests = [ForwardRequest(lane.sequence, chunk, "last" if wants else "none")
                    for lane, chunk, wants in work]
        start = time.monotonic()
        for lane, _, _ in work:
            if not lane.active.prefill_started:
                lane.active.prefill_started = start
        try:
            results = self.runner.forward(requests)
        except Exception as exc:
            return events + self._fail(work, exc)
        now = time.monotonic()
        for (lane, chunk, wants), logits in zip(work, results):
            gen = lane.active
            self.register_blocks(lane.sequence)
            if gen.pending:
                del gen.pending[: len(chunk)]
                self._capture(lane, gen)
                if gen.pending or not wants:
                    continue  # more to feed, or recomputed after preemption: decode the token already sampled
                gen.prefill_done = now
            gen.next_token = None
            try:
                events.extend(self._after_logits(lane, gen, logits[0], now))
            except Exception as exc:
                events.extend(self._fail([(lane, chunk, wants)], exc))
        return events

    def make_room(self, n_blocks: int) -> None:
        """Free idle lanes' histories (least recently used first), then prefix-cache snapshots (oldest
        first), until n_blocks can be allocated."""
        pool = self.runner.pool
        for lane in sorted((lane for lane in self.lanes if not lane.busy), key=lambda lane: lane.last_used):
            if pool.n_available >= n_blocks:
                return
            if lane.sequence.block_table.n_blocks:
                lane.forget(self.runner)
        if self.prefix_cache is not None:
            self.prefix_cache.drop_snapshots_until(n_blocks)

    def register_blocks(self, seq: SequenceState) -> None:
        """Hand every newly filled block to the prefix cache."""
        cache = self.prefix_cache
        if cache is None:
            return
        while len(seq.block_keys) < seq.n_past // BLOCK_SIZE:
            i = len(seq.block_keys)
            parent = seq.block_keys[-1] if seq.block_keys else ROOT_KEY
            tokens = seq.tokens[i * BLOCK_SIZE: (i + 1) * BLOCK_SIZE]
            seq.block_keys.append(cache.register(parent, tokens, int(seq.block_table.ids[i])))

    def _capture(self, lane: Lane, gen: ActiveGeneration) -> None:
        """At a stop, keep the recurrent state: as a lane checkpoint and/or as a prefix-cache snapshot."""
        seq = lane.sequence
        n = seq.n_past
        while gen.stops and gen.stops[0] < n:
            gen.stops.pop(0)
        if not gen.stops or gen.stops[0] != n:
            return
        gen.stops.pop(0)
        if n in self._lane_checkpoints_at(gen.request):
            lane.keep_checkpoint(n, seq.recurrent)
        if self.prefix_cache is not None and n % BLOCK_SIZE == 0:
            self.prefix_cache.add_snapshot(seq.block_keys[n // BLOCK_SIZE - 1], seq.recurrent)

    def _preempt(self, lane: Lane) -> None:
        """Drop a busy lane's KV; it recomputes its whole history (prompt and output so far) when scheduled."""
        gen = lane.active
        if gen is None:
            return
        seq = lane.sequence
        gen.pending = list(seq.tokens) + gen.pending
        lane.forget(self.runner)
        gen.stops = self._stops(gen.request, 0) if gen.next_token is None else []

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
        return events + self._finish(lane, gen, finish, now, timed_out, stopped_by_string)

    def _finish(self, lane: Lane, gen: ActiveGeneration, finish: str, now: float, timed_out: bool = False,
                stopped_by_string: bool = False) -> list[Event]:
        request = gen.request
        if gen.detokenizer is not None and not stopped_by_string:
            gen.text += gen.detokenizer.flush()
        tail = gen.text[gen.released:]
        gen.released = len(gen.text)
        prefill_end = gen.prefill_done or now
        timings = Timings(
            prompt_n=len(request.prompt) - gen.cached_tokens,
            prompt_ms=1000 * (prefill_end - (gen.prefill_started or gen.started)),
            predicted_n=len(gen.generated),
            predicted_ms=1000 * (now - prefill_end),
            ttft_ms=1000 * (gen.first_token_at - gen.started),
        )
        usage = Usage(len(request.prompt), gen.cached_tokens, len(gen.generated))
        self._retire(lane)
        return [FinishEvent(request.request_id, finish, tail, usage, timings, timed_out, lane.index)]

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
                self._retire(lane)
            lane.forget(self.runner)
        return events


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists (compared a block of tokens at a time:
    prompts of thousands of tokens are compared on every admission and scheduling step)."""
    n = min(len(a), len(b))
    i = 0
    while i + BLOCK_SIZE <= n and a[i:i + BLOCK_SIZE] == b[i:i + BLOCK_SIZE]:
        i += BLOCK_SIZE
    while i < n and a[i] == b[i]:
        i += 1
    return i
