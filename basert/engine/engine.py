"""Engine: the slots of one model advanced together, one batched forward per step.

Synchronous and free of trio. Two ways to drive it:

- `Engine.generate(requests)`: a synchronous driver that admits requests as slots free up, plans and
  runs steps, and yields the events (the Python API, the CLI, tools and tests use it);
- the actor's loop: `admit` / `cancel` between steps, `step(plan())` in a worker thread.

A step feeds each planned slot a chunk of its prompt or its last sampled token, samples from the logits,
and turns the tokens into events through each request's `RequestOutput`.

Speculative decoding: a decoding slot's last sampled token goes with up to K drafted tokens (`drafts.py`), all
fed in the same forward with logits at every position. The sampler then picks the token of each position in
turn, exactly as it would have one step at a time (the same logits bits: a position's logits do not depend on
the chunk it is computed in; the same history for penalties; the same random draws, one per sampled token), and
the drafts are kept while they equal its picks: the first pick that differs is the next token, as without
drafts. What the rejected drafts computed leaves no trace: their KV rows are truncated before any block reaches
the prefix cache, and a hybrid's recurrent state is restored from a copy taken before the forward and advanced
over the accepted tokens again.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np

from basert.engine.drafts import DEFAULT_DRAFT_MAX, NGRAM_SIZES, Drafter, SharedNgrams, StepCosts, draft_lengths
from basert.engine.embeddings import POOLINGS, EmbeddingJob, check_inputs
from basert.engine.info import ModelInfo
from basert.engine.kv import BLOCK_SIZE, blocks_for
from basert.engine.output import RequestOutput
from basert.engine.prefix_cache import PrefixCache
from basert.engine.runner import ContextOverflowError, ForwardRequest, ModelRunner
from basert.engine.sampler import Sampler
from basert.engine.saved_state import SnapshotInfo, load_prefix_cache, restore_slot, save_prefix_cache, save_slot
from basert.engine.scheduler import DEFAULT_TOKEN_BUDGET, plan_step
from basert.engine.sequence import RecurrentState
from basert.engine.slots import Running, Slot, Slots
from basert.engine.types import (
    Event,
    FailEvent,
    FinishEvent,
    GenerationRequest,
    SlotStatus,
    StepPlan,
    TokenEvent,
)
from basert.errors import InvalidRequestError
from basert.tokenizer import Tokenizer


class KVCacheTooSmallError(InvalidRequestError, ValueError):
    """A prompt needs more KV blocks than the whole pool holds."""


class NKeepError(InvalidRequestError, ValueError):
    """n_keep keeps more of the prompt than a context shift can work with."""

    param = "n_keep"


# A context shift keeps at most the context less this many tokens, so that it frees at least one position.
MIN_SHIFT = 4


class Engine:
    """Slots over one ModelRunner, optionally sharing a prefix cache; build one with `build_engine`."""

    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer | None, info: ModelInfo, *,
                 prefix_cache: PrefixCache | None = None, prefix_cache_file: Path | None = None,
                 max_running: int = 1, token_budget: int = DEFAULT_TOKEN_BUDGET,
                 draft_max: int = DEFAULT_DRAFT_MAX, context_shift: bool = False, n_keep: int = 0):
        self.runner = runner
        self.tokenizer = tokenizer
        self.info = info
        self.prefix_cache = prefix_cache
        self.prefix_cache_file = prefix_cache_file
        self.slots = Slots(runner, info.n_slots, prefix_cache)
        self.max_running = max_running      # requests generating at once (continuous batching: every slot)
        self.token_budget = token_budget    # most tokens one step feeds
        self.eos_ids = tokenizer.eos_ids if tokenizer is not None else frozenset()
        self.draft_max = draft_max          # most drafted tokens per step; 0: no speculative decoding
        self.shared_ngrams = SharedNgrams(draft_max) if draft_max else None
        self.step_costs = StepCosts()       # what feeding drafts costs on this machine, measured as steps run
        self.context_shift = context_shift  # a full context drops the oldest half after the kept prompt tokens
        self.n_keep = n_keep                # the prompt tokens kept by default (-1: all)
        self._admissions = 0

    # --- admission ----------------------------------------------------------------------------
    @property
    def n_running(self) -> int:
        return sum(slot.busy for slot in self.slots)

    @property
    def has_work(self) -> bool:
        return any(slot.busy for slot in self.slots)

    def slot_for(self, request: GenerationRequest, slot_hint: int | None = None) -> Slot | None:
        """The slot to admit a request into now (the hinted one, else the idle slot with the longest
        common prefix), or None when it must wait."""
        if self.n_running >= self.max_running:
            return None
        if slot_hint is not None:
            slot = self.slots[slot_hint]
            return None if slot.busy else slot
        return self.slots.idle_slot_for(request.prompt)

    def admit(self, request: GenerationRequest, slot: Slot) -> None:
        """Start a request on an idle slot, reusing what the slot or the prefix cache already computed."""
        if slot.busy:
            raise RuntimeError(f"slot {slot.index} is busy")
        self.check(request)
        request, truncated = self._fitted(request)
        reused = self.slots.reuse_prefix(slot, request.prompt)
        self._admissions += 1
        slot.running = Running(
            request=request,
            sampler=Sampler(request.sampling, self.runner.vocab_size),
            output=RequestOutput(request, self.tokenizer, reused),
            pending=list(request.prompt[reused:]),
            order=self._admissions,
            stops=self.slots.capture_points(request, reused),
            cache_version=self.prefix_cache.version if self.prefix_cache is not None else -1,
            drafter=self._drafter_for(request),
        )
        slot.running.output.truncated = truncated

    def _drafter_for(self, request: GenerationRequest) -> Drafter | None:
        """The request's drafter, None when it decodes without speculation."""
        limit = self.draft_max if request.draft_max is None else min(self.draft_max, request.draft_max)
        if not request.speculative or limit <= 0:
            return None
        return Drafter(limit, self.shared_ngrams, self.step_costs, self.tokenizer)

    def check(self, request: GenerationRequest) -> None:
        """Raise when a request can never run on this engine (its sampling parameters are checked by the
        Sampler at admission)."""
        if not request.prompt:
            raise ValueError("the prompt is empty")
        n_ctx = self.runner.max_context
        if self.context_shift:
            keep, most = self._kept(request), n_ctx - MIN_SHIFT
            if not 0 <= keep <= most:
                raise NKeepError(f"n_keep keeps {keep} tokens of the prompt; with context shift it keeps at most "
                                 f"{most} (the context is {n_ctx} tokens)")
        elif len(request.prompt) + 1 > n_ctx:
            raise ContextOverflowError(len(request.prompt), n_ctx)
        n_prompt = len(self._fitted(request)[0].prompt)
        if blocks_for(n_prompt + 1) > self.runner.pool.n_blocks:
            raise KVCacheTooSmallError(
                f"the prompt ({n_prompt} tokens) does not fit in the KV cache "
                f"({self.runner.pool.n_blocks * BLOCK_SIZE} tokens)")

    def _kept(self, request: GenerationRequest) -> int:
        """The prompt tokens a context shift keeps."""
        n_keep = self.n_keep if request.n_keep is None else request.n_keep
        return len(request.prompt) if n_keep == -1 else n_keep

    def _fitted(self, request: GenerationRequest) -> tuple[GenerationRequest, bool]:
        """The request with a prompt that fits the context, and whether it was cut to fit: with context shift a
        longer prompt keeps its first n_keep tokens and drops whole halves of the room after them, oldest first
        (llama.cpp's truncation), so that at least half of that room holds the prompt's last tokens."""
        prompt, n_ctx = request.prompt, self.runner.max_context
        if not self.context_shift or len(prompt) + 1 <= n_ctx:
            return request, False
        keep = self._kept(request)
        half = (n_ctx - keep) // 2
        erased = (len(prompt) - keep - half) // half * half
        return replace(request, prompt=[*prompt[:keep], *prompt[keep + erased:]],
                       segment_ends=tuple(end for end in request.segment_ends if end <= keep)), True

    def _shift(self, slot: Slot) -> None:
        """A decoding slot whose next token has no room left: keep the first n_keep tokens of its history, drop the
        oldest half of the rest and compute the remainder again (its KV positions change: recomputing is exact
        where re-rotating cached keys would not be); the token already sampled is fed after it."""
        running, seq = slot.running, slot.sequence
        keep = min(self._kept(running.request), seq.n_past)
        dropped = (seq.n_past - keep) // 2
        history = [*seq.tokens[:keep], *seq.tokens[keep + dropped:]]
        self.slots.forget(slot)
        running.pending = history
        running.stops = []
        running.draft = []
        running.drafter = self._drafter_for(running.request)  # its n-gram positions were of the old history
        running.output.truncated = True

    def cancel(self, request_id: str, reason: str = "cancelled") -> FinishEvent | None:
        """Stop a request; its slot is free at once (what it computed stays a valid prefix). The request's
        finish event (with `reason`), or None when it is not running."""
        for slot in self.slots:
            if slot.running is not None and slot.running.request.request_id == request_id:
                return self._finish(slot, reason, time.monotonic())
        return None

    # --- the synchronous driver ---------------------------------------------------------------
    def generate(self, requests: GenerationRequest | Iterable[GenerationRequest],
                 plans: list[StepPlan] | None = None) -> Iterator[Event]:
        """Run requests to completion, admitting each as a slot frees up (in order); yields every event.

        A request that cannot run yields a FailEvent. The consumer may `cancel` a request between events.
        `plans`, when given, receives each step's plan (to see how the scheduler ran the requests).
        """
        queue = deque([requests] if isinstance(requests, GenerationRequest) else requests)
        while queue or self.has_work:
            while queue and (slot := self.slot_for(queue[0])) is not None:
                request = queue.popleft()
                try:
                    self.admit(request, slot)
                except Exception as exc:  # a request that cannot run fails alone
                    yield FailEvent(request.request_id, exc)
            if self.has_work:
                plan = self.plan()
                if plans is not None:
                    plans.append(plan)
                yield from self.step(plan)

    # --- stepping -----------------------------------------------------------------------------
    def plan(self) -> StepPlan:
        """The scheduler's plan for the next step."""
        return plan_step(self.prepare_step(), self.slots.available_blocks(), self.token_budget)

    def prepare_step(self) -> list[SlotStatus]:
        """Let prefilling slots catch up with the prefix cache, choose the decoding slots' drafts, then report every
        busy slot for planning."""
        busy = [slot for slot in self.slots if slot.running is not None]
        for slot in busy:
            self.slots.catch_up(slot)
        self._choose_drafts([slot for slot in busy if not slot.running.pending])
        statuses = []
        for slot in busy:
            running, seq = slot.running, slot.sequence
            max_chunk = 1 + len(running.draft)
            if running.pending:
                max_chunk = len(running.pending)
                for stop in running.stops:
                    if stop > seq.n_past:
                        max_chunk = min(max_chunk, stop - seq.n_past)
                        break
            statuses.append(SlotStatus(slot.index, not running.pending, max_chunk, seq.n_past,
                                       seq.block_table.n_blocks, running.order, self.slots.waits_for_prefix(slot)))
        return statuses

    def _choose_drafts(self, decoding: list[Slot]) -> None:
        """The tokens each decoding slot tries after its next token, chosen together (`draft_lengths`): none beyond
        the context, the request's token limit or the step's token budget."""
        offers = []
        for slot in decoding:
            running, seq = slot.running, slot.sequence
            running.draft = []
            if running.drafter is None:
                continue
            # The last position verified is the context's last but one: a token sampled there is the last the
            # context holds (a context shift or the end comes after it, as without drafts).
            room = min(self.runner.max_context - seq.n_past - 2,
                       running.request.max_tokens - len(running.output.generated) - 1,
                       self.token_budget - 1)
            constraint = running.request.constraint
            forced = constraint.forced() if constraint is not None else ()
            offers.append((running.drafter, running.drafter.candidate(seq.tokens, running.next_token, room, forced),
                           slot))
        lengths = draft_lengths([(drafter.rate, len(offer)) for drafter, offer, _ in offers], len(decoding),
                                self.step_costs)
        for (drafter, offer, slot), k in zip(offers, lengths):
            slot.running.draft = drafter.settle(offer, k, len(decoding))

    def step(self, plan: StepPlan) -> list[Event]:
        """Carry out one plan: finish starved slots, preempt, then one forward over the planned chunks."""
        events: list[Event] = []
        for index in plan.starve:
            if self.slots[index].busy:
                events.append(self._finish(self.slots[index], "length", time.monotonic()))
        for index in plan.preempt:
            self.slots.preempt(self.slots[index])
        work: list[tuple[Slot, list[int], bool]] = []
        for index, n_tokens in plan.chunks:
            slot = self.slots[index]
            running = slot.running
            if running is None:
                continue
            if not running.pending:
                work.append((slot, [running.next_token, *running.draft[: n_tokens - 1]], True))
                continue
            chunk = running.pending[:n_tokens]
            last = len(chunk) == len(running.pending)
            work.append((slot, chunk, last and running.next_token is None))
        if not work:
            return events
        growth = [(slot.sequence, blocks_for(slot.sequence.n_past + len(chunk))) for slot, chunk, _ in work]
        self.slots.make_room(sum(n - seq.block_table.n_blocks for seq, n in growth),
                             sum(n - seq.window_table.n_blocks for seq, n in growth if seq.window_table is not None))
        # Logits of the last position, or of every position where drafts follow the next token.
        requests = [ForwardRequest(slot.sequence, chunk, "all" if len(chunk) > 1 and not slot.running.pending else
                                   "last" if wants else "none") for slot, chunk, wants in work]
        # A hybrid's state before its drafts, to go back to when some are rejected.
        before = {slot.index: slot.sequence.recurrent.clone() for slot, chunk, _ in work
                  if not slot.running.pending and len(chunk) > 1 and slot.sequence.recurrent is not None}
        start = time.monotonic()
        for slot, _, _ in work:
            if not slot.running.output.prefill_started:
                slot.running.output.prefill_started = start
        try:
            results = self.runner.forward(requests)
        except Exception as exc:
            return events + self._fail(work, exc)
        now = time.monotonic()
        if not any(slot.running.pending for slot, _, _ in work):
            self.step_costs.observe(sum(len(chunk) for _, chunk, _ in work), now - start)
        redo: list[tuple[Slot, list[int]]] = []
        for (slot, chunk, wants), logits in zip(work, results):
            running = slot.running
            if not running.pending:
                events.extend(self._verify(slot, chunk, logits, now, before.get(slot.index), redo))
                continue
            self.slots.register_blocks(slot.sequence)
            if running.pending:
                del running.pending[: len(chunk)]
                self.slots.capture(slot)
                if running.pending and running.output.out_of_time(now):
                    # A long prompt must not outlast its request's time: the deadline is checked between chunks.
                    running.output.prompt_not_computed = len(running.pending)
                    events.append(self._finish(slot, "length", now))
                    continue
                if running.pending or not wants:
                    continue  # more to feed, or recomputed after preemption: decode the token already sampled
                running.output.prefill_done = now
            running.next_token = None
            try:
                events.extend(self._sample(slot, logits[0], now))
            except Exception as exc:
                events.extend(self._fail([(slot, chunk, wants)], exc))
        if redo:
            events.extend(self._advance_again(redo))
        if self.context_shift:
            for slot, _, _ in work:
                running = slot.running
                if (running is not None and running.next_token is not None and not running.pending
                        and slot.sequence.n_past + 1 >= self.runner.max_context):
                    self._shift(slot)
        return events

    def _verify(self, slot: Slot, chunk: list[int], logits: np.ndarray, now: float, before: RecurrentState | None,
                redo: list[tuple[Slot, list[int]]]) -> list[Event]:
        """Sample a decoding slot's positions in turn while its drafts (chunk[1:]) are the sampler's picks; drop
        what the rest computed (a hybrid's accepted tokens go into `redo`, to be fed again from `before`)."""
        running = slot.running
        seq = slot.sequence
        start = seq.n_past - len(chunk)
        drafted = len(chunk) - 1
        running.next_token = None
        running.output.draft_n += drafted
        events: list[Event] = []
        kept = start + 1
        try:
            for i, row in enumerate(logits):
                kept = start + i + 1
                events.extend(self._sample(slot, row, now, kept))
                if slot.running is None or i == drafted or running.next_token != chunk[i + 1]:
                    break
                running.next_token = None
                running.output.draft_n_accepted += 1
        except Exception as exc:
            events.extend(self._fail([(slot, chunk, True)], exc))
            return events
        if running.drafter is not None:
            running.drafter.update(drafted, kept - start - 1)
        if kept < seq.n_past:
            if before is None:
                self.runner.truncate_kv(seq, kept)
            else:
                seq.recurrent.copy_from(before)
                self.runner.truncate_kv(seq, start)
                redo.append((slot, chunk[: kept - start]))
                return events
        self.slots.register_blocks(seq)
        return events

    def _advance_again(self, redo: list[tuple[Slot, list[int]]]) -> list[Event]:
        """Feed hybrid slots' accepted tokens again after their rejected drafts were undone."""
        try:
            self.runner.forward([ForwardRequest(slot.sequence, tokens, "none") for slot, tokens in redo])
        except Exception as exc:
            return self._fail([(slot, tokens, False) for slot, tokens in redo], exc)
        for slot, _ in redo:
            self.slots.register_blocks(slot.sequence)
        return []

    def _sample(self, slot: Slot, logits: np.ndarray, now: float, n_past: int | None = None) -> list[Event]:
        """Choose the token after the first n_past tokens of the slot's history (default: all of them)."""
        running = slot.running
        request, output = running.request, running.output
        seq = slot.sequence
        n_past = seq.n_past if n_past is None else n_past
        if request.constraint is not None:
            request.constraint.apply(logits)
        history = seq.tokens if n_past == seq.n_past or not running.sampler.uses_history else seq.tokens[:n_past]
        token, logprob = running.sampler.sample(logits, history)
        if not output.first_token_at:
            output.first_token_at = now
        if token in self.eos_ids and not request.ignore_eos:
            return [self._finish(slot, "stop", now)]
        if request.constraint is not None:
            request.constraint.consume(token)
        finish = output.add(token, n_past + 1 >= self.runner.max_context and not self.context_shift, now)
        if finish is None:
            running.next_token = token
            return [TokenEvent(request.request_id, token, output.releasable(), logprob)]
        return [TokenEvent(request.request_id, token, output.release_rest(), logprob), self._finish(slot, finish, now)]

    def _finish(self, slot: Slot, reason: str, now: float) -> FinishEvent:
        running = slot.running
        output = running.output
        if self.shared_ngrams is not None and running.drafter is not None and output.generated:
            # Other requests may write what this one did: its output, after the prompt's last n-gram.
            lead = running.request.prompt[-NGRAM_SIZES[0]:]
            self.shared_ngrams.learn([*lead, *output.generated])
        tail, usage, timings = output.close(now)
        self.slots.retire(slot)
        return FinishEvent(output.request.request_id, reason, tail, usage, timings, slot.index, output.timed_out,
                           output.stop_word, output.truncated)

    def _fail(self, work: list[tuple[Slot, list[int], bool]], exc: Exception) -> list[Event]:
        events: list[Event] = []
        for slot, _, _ in work:
            if slot.running is not None:
                events.append(FailEvent(slot.running.request.request_id, exc))
                self.slots.retire(slot)
            self.slots.forget(slot)
        return events

    # --- one sequence, step by step (basert.Model's low-level API) ----------------------------
    def prefill(self, tokens: list[int], slot_index: int = 0) -> tuple[np.ndarray, int]:
        """Continue an idle slot's history with a prompt, reusing the longest usable prefix; the last
        position's logits (a copy) and the number of reused tokens."""
        slot = self.slots[slot_index]
        if not tokens:
            raise ValueError("the prompt is empty")
        reused = self.slots.reuse_prefix(slot, tokens)
        rest = tokens[reused:]
        try:
            # Fed a token budget at a time, as a step would (the same bits: a position's KV and logits do not
            # depend on the chunk it is computed in), so that the window layers' pool holds the chunks.
            for start in range(0, len(rest), self.token_budget):
                chunk = rest[start: start + self.token_budget]
                wanted = "last" if start + len(chunk) == len(rest) else "none"
                results = self.runner.forward([ForwardRequest(slot.sequence, chunk, wanted)])
            logits = results[0][0].copy()
        except Exception:
            self.slots.forget(slot)
            raise
        return logits, reused

    def decode(self, token: int, slot_index: int = 0) -> np.ndarray:
        """Append one token to an idle slot's history; the logits of the next position, a scratch view valid
        until the next forward."""
        return self.runner.forward([ForwardRequest(self.slots[slot_index].sequence, [int(token)])])[0][0]

    # --- embeddings ---------------------------------------------------------------------------
    def check_embedding(self, token_lists: list[list[int]]) -> None:
        """Raise for the first input that cannot be embedded (none at all, empty, too long, bad token ids)."""
        check_inputs(token_lists, self.runner.vocab_size, self.runner.max_context)

    def start_embedding(self, token_lists: list[list[int]], pooling: str | None = None) -> EmbeddingJob:
        """`embed` of inputs that `check_embedding` accepted, one token budget per `EmbeddingJob.step()`, for a
        driver that runs generation steps in between (its KV is its own, so those steps cannot disturb it); the
        vectors are the bits `embed` gives."""
        return EmbeddingJob(self.runner, token_lists, self.token_budget, self.pooling_of(pooling), interleaved=True)

    def pooling_of(self, pooling: str | None) -> str:
        pooling = pooling or self.info.pooling
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, not {pooling!r}")
        return pooling

    def embed(self, token_lists: list[list[int]], pooling: str | None = None) -> np.ndarray:
        """L2-normalised embeddings [len(token_lists), hidden] float32: each input's last hidden states (the
        final norm's output) pooled by `pooling` ("mean", "last", "cls"; default: the model's). Each input
        runs as a fresh scratch sequence: no slot, cached block or recurrent state is touched, and an input's
        vector is the same alone or with others."""
        self.check_embedding(token_lists)
        job = EmbeddingJob(self.runner, token_lists, self.token_budget, self.pooling_of(pooling), interleaved=False)
        try:
            while not job.step():
                pass
        finally:
            job.close()
        return job.vectors

    # --- saved state --------------------------------------------------------------------------
    def save_slot(self, slot_index: int, path: Path) -> SnapshotInfo:
        """Write an idle slot's history (tokens, KV, recurrent states) to a snapshot file."""
        return save_slot(self.runner, self.slots[slot_index], path)

    def restore_slot(self, slot_index: int, path: Path) -> SnapshotInfo:
        """Replace an idle slot's history with a snapshot file's; a refused file leaves the slot empty, never
        half-restored or stale."""
        slot = self.slots[slot_index]
        try:
            return restore_slot(self.runner, self.slots, slot, path)
        except Exception:
            self.slots.forget(slot)
            raise

    def load_prefix_cache(self) -> int:
        """Warm the prefix cache from its file; the number of blocks loaded (raises when it is unusable)."""
        if self.prefix_cache is None or self.prefix_cache_file is None:
            return 0
        return load_prefix_cache(self.runner, self.prefix_cache, self.prefix_cache_file)

    def save_prefix_cache(self) -> int | None:
        """Write the prefix cache file atomically; the number of blocks written, None without a file."""
        if self.prefix_cache is None or self.prefix_cache_file is None:
            return None
        return save_prefix_cache(self.runner, self.prefix_cache, self.prefix_cache_file)

    def stats(self) -> dict:
        pool, window_pool = self.runner.pool, self.runner.window_pool
        return {"busy_slots": self.n_running, "kv_blocks_total": pool.n_blocks, "kv_blocks_used": pool.n_used,
                "kv_window_blocks_total": window_pool.n_blocks if window_pool is not None else 0,
                "kv_window_blocks_used": window_pool.n_used if window_pool is not None else 0,
                "kv_bytes": self.runner.kv.nbytes,
                "prefix_cache": self.prefix_cache.stats() if self.prefix_cache is not None else None}

    def erase(self, slot_index: int) -> int:
        """Forget a slot's history; the number of tokens it held."""
        slot = self.slots[slot_index]
        n = slot.sequence.n_past
        self.slots.forget(slot)
        return n

    def close(self) -> None:
        self.runner.close()
