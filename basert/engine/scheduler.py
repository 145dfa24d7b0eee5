"""Scheduling policy of one engine: which slots advance in the next step, and by how many tokens.

Pure functions of the slots' status, so they are tested without a model. Decoding slots go first (one
token each, and as many of its drafts after it as the budget and the KV blocks allow), then prefill chunks of
the oldest requests up to the step's token budget (a slot whose prompt prefix an older slot is computing
waits, to adopt those blocks from the prefix cache). KV blocks are granted oldest first; a slot that gets
none waits. When no slot can move at all, the youngest slot that
holds blocks is preempted (its KV is dropped and recomputed later), and a slot that could not grow even
with the whole pool is finished.
"""

from __future__ import annotations

from collections.abc import Sequence

from basert.engine.kv import BLOCK_SIZE, blocks_for
from basert.engine.types import SlotStatus, StepPlan

# Tokens of one forward. Its working memory grows with it (a 1.5B model: 6 MiB per 256 rows) and its speed does
# not beyond 128-256 (Qwen2.5-Coder-1.5B pp512 at 512, 256 and 128: the same within this machine's noise).
DEFAULT_TOKEN_BUDGET = 256


def plan_step(slots: Sequence[SlotStatus], available_blocks: int,
              token_budget: int = DEFAULT_TOKEN_BUDGET) -> StepPlan:
    """The next step for these busy slots, given the KV blocks a step may still allocate."""
    chunks: list[tuple[int, int]] = []
    stuck: list[SlotStatus] = []
    budget = token_budget
    for slot in sorted(slots, key=lambda slot: (not slot.decoding, slot.order)):
        if slot.waits_for_prefix:
            continue
        # A decoding slot feeds its next token and any drafts after it (drafts only as far as room allows).
        want = max(1, min(slot.max_chunk, budget)) if slot.decoding else min(slot.max_chunk, budget)
        if want <= 0:
            continue
        fits = (slot.n_blocks + available_blocks) * BLOCK_SIZE - slot.n_past
        if want > fits:
            if fits <= 0:
                stuck.append(slot)
                continue
            want = fits
        available_blocks -= blocks_for(slot.n_past + want) - slot.n_blocks
        budget -= want
        chunks.append((slot.slot, want))
    if chunks or not stuck:
        return StepPlan(tuple(chunks))
    oldest = min(stuck, key=lambda slot: slot.order)
    holders = [slot for slot in slots if slot.n_blocks and slot.slot != oldest.slot]
    if holders:
        return StepPlan(preempt=(max(holders, key=lambda slot: slot.order).slot,))
    return StepPlan(starve=(oldest.slot,))
