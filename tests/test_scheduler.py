"""The engine's scheduling policy on made-up slot states (no model)."""

from __future__ import annotations

from basert.engine.scheduler import plan_step
from basert.engine.types import SlotStatus


def decoding(slot: int, n_past: int, order: int) -> SlotStatus:
    return SlotStatus(slot, True, 0, n_past, (n_past + 15) // 16, order)


def prefilling(slot: int, pending: int, order: int, n_past: int = 0) -> SlotStatus:
    return SlotStatus(slot, False, pending, n_past, (n_past + 15) // 16, order)


def test_decode_first_then_prefill_oldest_first_up_to_the_budget():
    slots = [prefilling(2, 300, order=3), decoding(0, 40, order=1), prefilling(1, 400, order=2),
             decoding(3, 10, order=4)]
    plan = plan_step(slots, available_blocks=100, token_budget=512)
    assert plan.chunks == ((0, 1), (3, 1), (1, 400), (2, 110))
    assert not plan.preempt and not plan.starve


def test_prefill_chunks_stop_at_the_slot_limit():
    plan = plan_step([prefilling(0, 31, order=1)], available_blocks=100, token_budget=512)
    assert plan.chunks == ((0, 31),)


def test_blocks_are_granted_oldest_first_and_a_slot_without_blocks_waits():
    slots = [prefilling(0, 64, order=1), prefilling(1, 64, order=2)]
    plan = plan_step(slots, available_blocks=5, token_budget=512)
    assert plan.chunks == ((0, 64), (1, 16))
    plan = plan_step(slots, available_blocks=4, token_budget=512)
    assert plan.chunks == ((0, 64),)


def test_a_decode_that_needs_a_new_block_waits_while_others_move():
    slots = [decoding(0, 32, order=1), decoding(1, 20, order=2)]   # slot 0 is at a block boundary
    plan = plan_step(slots, available_blocks=0, token_budget=512)
    assert plan.chunks == ((1, 1),)


def test_when_nobody_can_move_the_youngest_holder_is_preempted():
    slots = [decoding(0, 32, order=1), decoding(1, 48, order=2), decoding(2, 64, order=3)]
    plan = plan_step(slots, available_blocks=0, token_budget=512)
    assert plan.chunks == () and plan.preempt == (2,)


def test_a_slot_alone_without_room_is_finished():
    plan = plan_step([decoding(0, 64, order=1)], available_blocks=0, token_budget=512)
    assert plan.starve == (0,) and not plan.preempt


def test_no_slots_no_plan():
    plan = plan_step([], available_blocks=10)
    assert plan.chunks == () and not plan.preempt and not plan.starve


def test_a_slot_waiting_for_an_older_slots_prefix_gets_no_chunk():
    waiting = SlotStatus(1, False, 300, 0, 0, 2, waits_for_prefix=True)
    plan = plan_step([prefilling(0, 300, order=1), waiting], available_blocks=100, token_budget=512)
    assert plan.chunks == ((0, 300),)
