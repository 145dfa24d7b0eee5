"""The actor's scheduling policy on made-up lane states (no model)."""

from __future__ import annotations

from basert.actor.scheduler import plan_step
from basert.engine.engine import LaneStatus


def decoding(lane: int, n_past: int, order: int) -> LaneStatus:
    return LaneStatus(lane, True, 0, n_past, (n_past + 15) // 16, order)


def prefilling(lane: int, pending: int, order: int, n_past: int = 0) -> LaneStatus:
    return LaneStatus(lane, False, pending, n_past, (n_past + 15) // 16, order)


def test_decode_first_then_prefill_oldest_first_up_to_the_budget():
    lanes = [prefilling(2, 300, order=3), decoding(0, 40, order=1), prefilling(1, 400, order=2),
             decoding(3, 10, order=4)]
    plan = plan_step(lanes, available_blocks=100, token_budget=512)
    assert plan.chunks == ((0, 1), (3, 1), (1, 400), (2, 110))
    assert not plan.preempt and not plan.starve


def test_prefill_chunks_stop_at_the_lane_limit():
    plan = plan_step([prefilling(0, 31, order=1)], available_blocks=100, token_budget=512)
    assert plan.chunks == ((0, 31),)


def test_blocks_are_granted_oldest_first_and_a_lane_without_blocks_waits():
    lanes = [prefilling(0, 64, order=1), prefilling(1, 64, order=2)]
    plan = plan_step(lanes, available_blocks=5, token_budget=512)
    assert plan.chunks == ((0, 64), (1, 16))
    plan = plan_step(lanes, available_blocks=4, token_budget=512)
    assert plan.chunks == ((0, 64),)


def test_a_decode_that_needs_a_new_block_waits_while_others_move():
    lanes = [decoding(0, 32, order=1), decoding(1, 20, order=2)]   # lane 0 is at a block boundary
    plan = plan_step(lanes, available_blocks=0, token_budget=512)
    assert plan.chunks == ((1, 1),)


def test_when_nobody_can_move_the_youngest_holder_is_preempted():
    lanes = [decoding(0, 32, order=1), decoding(1, 48, order=2), decoding(2, 64, order=3)]
    plan = plan_step(lanes, available_blocks=0, token_budget=512)
    assert plan.chunks == () and plan.preempt == (2,)


def test_a_lane_alone_without_room_is_finished():
    plan = plan_step([decoding(0, 64, order=1)], available_blocks=0, token_budget=512)
    assert plan.starve == (0,) and not plan.preempt


def test_no_lanes_no_plan():
    plan = plan_step([], available_blocks=10)
    assert plan.chunks == () and not plan.preempt and not plan.starve


def test_a_lane_waiting_for_an_older_lanes_prefix_gets_no_chunk():
    waiting = LaneStatus(1, False, 300, 0, 0, 2, waits_for_prefix=True)
    plan = plan_step([prefilling(0, 300, order=1), waiting], available_blocks=100, token_budget=512)
    assert plan.chunks == ((0, 300),)
