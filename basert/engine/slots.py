"""Slots: each keeps one sequence's history between requests and runs at most one request at a time.

This module decides what a new request can reuse, so that it computes as little as possible while its
output stays exactly what it would be on a fresh engine:

- its slot's own history: attention KV is truncated to the common prefix; a recurrent (Gated DeltaNet)
  state cannot be rewound, so a hybrid resumes only from an exact extension of the history or from one of
  the checkpoints the slot captured at chat-segment ends and just before the last prompt token;
- or a prefix-cache hit (full 16-token blocks, for hybrids only up to a block that has a state snapshot).

A model with sliding-window layers resumes its own history only where it still holds the window layers' blocks
that the next token reads (see `ModelRunner.resumable`), and a hit only where they are cached.

At least the last prompt token is always computed, for its logits. While a request prefills, a slot also
adopts blocks that other slots cached since it was admitted, and idle slots give their blocks back when
the KV pool runs short (least recently used first).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from basert.engine.drafts import Drafter
from basert.engine.kv import BLOCK_SIZE, NO_BLOCK
from basert.engine.output import RequestOutput
from basert.engine.prefix_cache import ROOT_KEY, CacheHit, PrefixCache
from basert.engine.runner import ModelRunner
from basert.engine.sampler import Sampler
from basert.engine.sequence import RecurrentState, SequenceState
from basert.engine.types import GenerationRequest
from basert.tokenizer import common_prefix

MAX_SLOT_CHECKPOINTS = 4


@dataclass(slots=True)
class Checkpoint:
    """The recurrent state after the first n_tokens of the slot's history."""

    n_tokens: int
    state: RecurrentState


@dataclass(slots=True)
class Running:
    """The request a slot is running, and how far it got."""

    request: GenerationRequest
    sampler: Sampler
    output: RequestOutput
    pending: list[int]              # tokens still to feed before decoding (prompt, or history after preemption)
    order: int                      # admission order: lower is older
    stops: list[int] = field(default_factory=list)  # positions where the recurrent state is captured, ascending
    cache_version: int = -1         # prefix-cache version this slot last looked up
    next_token: int | None = None   # sampled, not yet fed
    drafter: Drafter | None = None  # speculative decoding's drafts (None: the request decodes without)
    draft: list[int] = field(default_factory=list)  # tokens to try after next_token in the next step


class Slot:
    """A sequence with its history, its hybrid checkpoints, and at most one running request."""

    def __init__(self, index: int, sequence: SequenceState):
        self.index = index
        self.sequence = sequence
        self.running: Running | None = None
        self.checkpoints: list[Checkpoint] = []   # hybrids: states at earlier points of the history, ascending
        self.last_used = 0

    @property
    def busy(self) -> bool:
        return self.running is not None

    def keep_checkpoint(self, n_tokens: int, state: RecurrentState) -> None:
        """Remember the state after n_tokens (at most MAX_SLOT_CHECKPOINTS; the first one, usually the
        system prompt's end, is kept longest)."""
        self.checkpoints = [c for c in self.checkpoints if c.n_tokens != n_tokens]
        self.checkpoints.append(Checkpoint(n_tokens, state.clone()))
        self.checkpoints.sort(key=lambda c: c.n_tokens)
        if len(self.checkpoints) > MAX_SLOT_CHECKPOINTS:
            del self.checkpoints[1]


class Slots:
    """The slots of one runner, and what they share: the KV pool and (optionally) the prefix cache."""

    def __init__(self, runner: ModelRunner, n_slots: int, prefix_cache: PrefixCache | None):
        self.runner = runner
        self.prefix_cache = prefix_cache
        self.all = [Slot(i, runner.new_sequence()) for i in range(n_slots)]
        self.hybrid = runner.n_linear_layers > 0
        self._uses = 0

    def __getitem__(self, index: int) -> Slot:
        return self.all[index]

    def __iter__(self):
        return iter(self.all)

    def __len__(self) -> int:
        return len(self.all)

    def forget(self, slot: Slot) -> None:
        """Drop a slot's history: blocks back to the pool (cached ones stay findable), state zeroed."""
        self.runner.release(slot.sequence)
        slot.checkpoints.clear()

    def retire(self, slot: Slot) -> None:
        """The slot's request is over; its history stays for reuse."""
        slot.running = None
        self._uses += 1
        slot.last_used = self._uses

    def idle_slot_for(self, prompt: list[int]) -> Slot | None:
        """The idle slot whose history shares the longest prefix with the prompt."""
        idle = [slot for slot in self.all if not slot.busy]
        if not idle:
            return None
        return max(idle, key=lambda slot: (common_prefix(slot.sequence.tokens, prompt), -slot.index))

    # --- reuse at admission -------------------------------------------------------------------
    def reuse_prefix(self, slot: Slot, prompt: list[int]) -> int:
        """Prepare the slot's sequence to continue after the longest reusable prefix; its length."""
        limit = len(prompt) - 1  # the last prompt token is always computed, for its logits
        own = self._own_reusable(slot, prompt, limit)
        cache = self.prefix_cache
        hit = cache.lookup(prompt, limit) if cache is not None else None
        if hit is not None and hit.n_tokens > own:
            self._adopt_hit(slot, prompt, hit)
            cache.count_hit(hit.n_tokens)
            return hit.n_tokens
        self._resume_own(slot, own)
        if cache is not None:
            cache.count_hit(own)
        return own

    def _own_reusable(self, slot: Slot, prompt: list[int], limit: int) -> int:
        seq = slot.sequence
        common = min(common_prefix(seq.tokens, prompt), limit)
        if not self.runner.resumable(seq, common):
            return 0    # the window layers' KV before `common` is gone (an earlier n resumes even less)
        if seq.recurrent is None or common == seq.n_past:
            return common
        usable = [c.n_tokens for c in slot.checkpoints
                  if c.n_tokens <= common and self.runner.resumable(seq, c.n_tokens)]
        return max(usable, default=0)

    def _resume_own(self, slot: Slot, n_tokens: int) -> None:
        seq = slot.sequence
        if n_tokens == seq.n_past:
            return
        if n_tokens == 0:
            self.forget(slot)
            return
        if seq.recurrent is not None:
            # _own_reusable only resumes at a checkpoint; later ones belong to the abandoned history.
            slot.checkpoints = [c for c in slot.checkpoints if c.n_tokens <= n_tokens]
            seq.recurrent.copy_from(slot.checkpoints[-1].state)
        self.runner.truncate_kv(seq, n_tokens)

    def _adopt_hit(self, slot: Slot, prompt: list[int], hit: CacheHit) -> None:
        """Replace the slot's history with a prefix-cache hit."""
        seq = slot.sequence
        self.forget(slot)
        seq.block_table.adopt(hit.blocks, self.runner.pool)
        if seq.window_table is not None:
            seq.window_table.adopt(hit.window_blocks, self.runner.window_pool)
        seq.tokens.extend(prompt[: hit.n_tokens])
        seq.block_keys.extend(hit.keys)
        if seq.recurrent is not None:
            seq.recurrent.copy_from(hit.snapshot)

    # --- hybrid checkpoints -------------------------------------------------------------------
    def capture_points(self, request: GenerationRequest, reused: int) -> list[int]:
        """Where a hybrid's prefill pauses to capture its recurrent state (after the reused prefix)."""
        if not self.hybrid:
            return []
        n = len(request.prompt)
        stops = set(self._checkpoints_at(request))
        if self.prefix_cache is not None:
            aligned = [(p // BLOCK_SIZE) * BLOCK_SIZE for p in (*request.segment_ends, n, n - 1)]
            stops.update(p for p in aligned if 0 < p <= n)
        return sorted(p for p in stops if p > reused)

    @staticmethod
    def _checkpoints_at(request: GenerationRequest) -> set[int]:
        """Where a hybrid slot keeps its own checkpoints: segment ends (the next turn of a conversation
        shares them) and just before the last prompt token (a resent prompt resumes there)."""
        n = len(request.prompt)
        return {p for p in request.segment_ends if 0 < p < n} | {n - 1}

    def capture(self, slot: Slot) -> None:
        """At a capture point, keep the recurrent state: as a slot checkpoint and/or a prefix-cache snapshot."""
        running = slot.running
        seq = slot.sequence
        n = seq.n_past
        while running.stops and running.stops[0] < n:
            running.stops.pop(0)
        if not running.stops or running.stops[0] != n:
            return
        running.stops.pop(0)
        if n in self._checkpoints_at(running.request):
            slot.keep_checkpoint(n, seq.recurrent)
        if self.prefix_cache is not None and n % BLOCK_SIZE == 0:
            self.prefix_cache.add_snapshot(seq.block_keys[n // BLOCK_SIZE - 1], seq.recurrent)

    # --- sharing while running ----------------------------------------------------------------
    def catch_up(self, slot: Slot) -> None:
        """A slot still prefilling its prompt adopts what other slots cached since it was admitted.

        The scheduler gives the prefill budget to the oldest request first, so of several concurrent
        requests with a common prefix one computes it and the others then start from its blocks.
        """
        cache = self.prefix_cache
        running = slot.running
        if cache is None or not running.pending or cache.version == running.cache_version \
                or running.next_token is not None or running.output.generated:
            return
        running.cache_version = cache.version
        prompt = running.request.prompt
        hit = cache.lookup(prompt, len(prompt) - 1, count=False)
        if hit.n_tokens <= slot.sequence.n_past:
            return
        self._adopt_hit(slot, prompt, hit)
        cache.count_hit(hit.n_tokens - running.output.cached_tokens)
        running.output.cached_tokens = hit.n_tokens
        running.pending = list(prompt[hit.n_tokens:])
        running.stops = self.capture_points(running.request, hit.n_tokens)

    def waits_for_prefix(self, slot: Slot) -> bool:
        """Whether an older slot still prefilling will cache blocks of this slot's prompt it has not computed."""
        running = slot.running
        if self.prefix_cache is None or not running.pending or running.output.generated:
            return False
        prompt = running.request.prompt
        for other in self.all:
            leader = other.running
            if leader is None or leader.order > running.order or other is slot or not leader.pending:
                continue
            shared = common_prefix(leader.request.prompt, prompt)
            if (shared // BLOCK_SIZE) * BLOCK_SIZE > slot.sequence.n_past and other.sequence.n_past < shared:
                return True
        return False

    def register_blocks(self, seq: SequenceState) -> None:
        """Hand every newly filled block to the prefix cache."""
        cache = self.prefix_cache
        if cache is None:
            return
        window = seq.window_table
        while len(seq.block_keys) < seq.n_past // BLOCK_SIZE:
            i = len(seq.block_keys)
            parent = seq.block_keys[-1] if seq.block_keys else ROOT_KEY
            tokens = seq.tokens[i * BLOCK_SIZE: (i + 1) * BLOCK_SIZE]
            window_block = int(window.ids[i]) if window is not None and i >= window.first else NO_BLOCK
            seq.block_keys.append(cache.register(parent, tokens, int(seq.block_table.ids[i]), window_block))

    # --- KV blocks ----------------------------------------------------------------------------
    def available_blocks(self) -> int:
        """Blocks a step can use: free, evictable from the cache, held only by idle slots' histories, or
        charged for prefix-cache snapshots."""
        pool = self.runner.pool
        idle_only = sum(int(np.count_nonzero(pool.ref_counts[slot.sequence.block_table.view()] == 1))
                        for slot in self.all if not slot.busy)
        snapshots = self.prefix_cache.snapshot_blocks if self.prefix_cache is not None else 0
        return pool.n_available + idle_only + snapshots

    def make_room(self, n_blocks: int, n_window_blocks: int = 0) -> None:
        """Free idle slots' histories (least recently used first), then prefix-cache snapshots (oldest
        first), until n_blocks (and n_window_blocks of the window layers' pool) can be allocated."""
        pool, window_pool = self.runner.pool, self.runner.window_pool
        for slot in sorted((slot for slot in self.all if not slot.busy), key=lambda slot: slot.last_used):
            if pool.n_available >= n_blocks and (window_pool is None or window_pool.n_available >= n_window_blocks):
                return
            if slot.sequence.block_table.n_blocks:
                self.forget(slot)
        if self.prefix_cache is not None:
            self.prefix_cache.drop_snapshots_until(n_blocks)

    def preempt(self, slot: Slot) -> None:
        """Drop a busy slot's KV; it recomputes its whole history (prompt and output so far) when scheduled."""
        running = slot.running
        if running is None:
            return
        running.pending = list(slot.sequence.tokens) + running.pending
        self.forget(slot)
        running.stops = self.capture_points(running.request, 0) if running.next_token is None else []
