"""Scheduling policy of one model's actor: which lanes advance in the next step, and by how many tokens.

Pure functions of the lanes' status, so they are tested without a model. Decoding lanes go first (one
token each), then prefill chunks of the oldest requests up to the step's token budget (a lane whose
prompt prefix an older lane is computing waits, to adopt those blocks from the prefix cache). KV blocks are
granted oldest first; a lane that gets none waits. When no lane can move at all, the youngest lane that
holds blocks is preempted (its KV is dropped and recomputed later), and a lane that could not grow even
with the whole pool is finished.
"""

from __future__ import annotations

from collections.abc import Sequence

from basert.engine.engine import LaneStatus, StepPlan
from basert.engine.kv import BLOCK_SIZE, blocks_for

DEFAULT_TOKEN_BUDGET = 512


def plan_step(lanes: Sequence[LaneStatus], available_blocks: int,
              token_budget: int = DEFAULT_TOKEN_BUDGET) -> StepPlan:
    """The next step for these busy lanes, given the KV blocks a step may still allocate."""
    chunks: list[tuple[int, int]] = []
    stuck: list[LaneStatus] = []
    budget = token_budget
    for lane in sorted(lanes, key=lambda lane: (not lane.decoding, lane.order)):
        if lane.waits_for_prefix:
            continue
        want = 1 if lane.decoding else min(lane.max_chunk, budget)
        if want <= 0:
            continue
        fits = (lane.n_blocks + available_blocks) * BLOCK_SIZE - lane.n_past
        if want > fits:
            if lane.decoding or fits <= 0:
                stuck.append(lane)
                continue
            want = fits
        available_blocks -= blocks_for(lane.n_past + want) - lane.n_blocks
        budget -= want
        chunks.append((lane.lane, want))
    if chunks or not stuck:
        return StepPlan(tuple(chunks))
    oldest = min(stuck, key=lambda lane: lane.order)
    holders = [lane for lane in lanes if lane.n_blocks and lane.lane != oldest.lane]
    if holders:
        return StepPlan(preempt=(max(holders, key=lambda lane: lane.order).lane,))
    return StepPlan(starve=(oldest.lane,))
