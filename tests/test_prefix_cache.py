"""Block pool and prefix cache without a model: reference counts, LRU eviction, sharing rules, collisions."""

from __future__ import annotations

import numpy as np
import pytest

from basert.engine.kv import BLOCK_SIZE, BlockPool, BlockTable, OutOfBlocksError
from basert.engine.prefix_cache import ROOT_KEY, PrefixCache
from basert.engine.sequence import RecurrentState
from basert.tokenizer import common_prefix


def tokens(start: int, n_blocks: int) -> list[int]:
    return list(range(start, start + n_blocks * BLOCK_SIZE))


def fill(cache: PrefixCache, pool: BlockPool, prompt: list[int]) -> tuple[BlockTable, list[int]]:
    """A sequence that computed `prompt` (whole blocks) and registered each full block, as the engine does."""
    table = BlockTable(64)
    table.ensure(len(prompt), pool)
    keys = []
    for i in range(len(prompt) // BLOCK_SIZE):
        keys.append(cache.register(keys[-1] if keys else ROOT_KEY, prompt[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE],
                                   int(table.ids[i])))
    return table, keys


def released(pool_blocks: int, starts: tuple[int, int], n_blocks: int) -> tuple[BlockPool, PrefixCache]:
    """A pool whose cache holds two prompts of n_blocks blocks each, computed in order and released in order."""
    pool = BlockPool(pool_blocks)
    cache = PrefixCache(pool, "model")
    tables = [fill(cache, pool, tokens(start, n_blocks))[0] for start in starts]
    for table in tables:
        table.release_all(pool)
    return pool, cache


def test_reference_counts_and_free_list():
    pool = BlockPool(4)
    a, b = pool.allocate(), pool.allocate()
    assert (a, b) == (0, 1) and pool.n_free == 2
    pool.retain(a)
    pool.release(a)
    assert pool.n_free == 2
    pool.release(a)
    assert pool.n_free == 3
    with pytest.raises(ValueError):
        pool.release(a)
    with pytest.raises(ValueError):
        pool.retain(a)
    for _ in range(3):
        pool.allocate()
    with pytest.raises(OutOfBlocksError):
        pool.allocate()


def test_cached_blocks_outlive_their_sequence_and_are_evicted_oldest_first():
    pool, cache = released(6, (0, 100), 2)
    assert pool.n_free == 2 and len(pool.evictable) == 4 and pool.n_available == 6
    assert cache.lookup(tokens(0, 2) + [7], 33).n_tokens == 32
    # Fresh allocations take free blocks first, then evict the least recently released cached ones
    # (a sequence releases its last block first, so a chain loses its tail before its head).
    held = [pool.allocate() for _ in range(3)]
    assert cache.n_cached_blocks == 3
    assert cache.lookup(tokens(0, 2) + [7], 33).n_tokens == 16
    held.append(pool.allocate())
    assert cache.lookup(tokens(0, 2) + [7], 33).n_tokens == 0
    assert cache.lookup(tokens(100, 2) + [7], 33).n_tokens == 32
    for block in held:
        pool.release(block)


def test_a_hit_revives_blocks_from_the_lru_and_moves_them_to_the_back():
    pool, cache = released(4, (0, 50), 1)
    hit = cache.lookup(tokens(0, 1) + [1], 17)
    reader = BlockTable(4)
    reader.adopt(hit.blocks, pool)                 # block of prompt A is held again: not evictable
    reader.release_all(pool)                       # ... and released last, so it is now the newest
    pool.allocate(), pool.allocate(), pool.allocate()
    assert cache.lookup(tokens(50, 1) + [1], 17).n_tokens == 0
    assert cache.lookup(tokens(0, 1) + [1], 17).n_tokens == 16


def test_hits_leave_the_last_token_and_stop_at_the_first_difference():
    pool = BlockPool(8)
    cache = PrefixCache(pool, "model")
    prompt = tokens(0, 3)
    fill(cache, pool, prompt)
    assert cache.lookup(prompt, len(prompt) - 1).n_tokens == 32     # the third block would cover the last token
    assert cache.lookup(prompt + [5], len(prompt)).n_tokens == 48
    changed = prompt[:20] + [9999] + prompt[21:]
    assert cache.lookup(changed, len(changed)).n_tokens == 16
    assert cache.lookup(prompt, 15).n_tokens == 0


def test_keys_depend_on_the_whole_prefix_and_the_model():
    pool = BlockPool(8)
    cache = PrefixCache(pool, "model-a")
    other = PrefixCache(BlockPool(8), "model-b")
    block = tokens(0, 1)
    assert cache.key(ROOT_KEY, block) != cache.key(cache.key(ROOT_KEY, block), block)
    assert cache.key(ROOT_KEY, block) != other.key(ROOT_KEY, block)


def test_no_block_is_shared_while_writable():
    pool = BlockPool(8)
    cache = PrefixCache(pool, "model")
    table, _ = fill(cache, pool, tokens(0, 2) + [1, 2, 3])
    full, partial = int(table.ids[1]), int(table.ids[2])
    assert pool.is_shared(full)          # full and registered: read-only from now on
    assert not pool.is_shared(partial)   # the block being written is the sequence's own
    assert partial not in pool.cached
    with pytest.raises(ValueError):
        cache.register(ROOT_KEY, [1, 2, 3], partial)


def test_a_hash_collision_is_caught_by_comparing_tokens():
    pool = BlockPool(8)
    cache = PrefixCache(pool, "model")
    prompt = tokens(0, 1)
    fill(cache, pool, prompt)
    impostor = tokens(500, 1)
    # Force a collision: the impostor's key now points at the entry of another prefix.
    cache.entries[cache.key(ROOT_KEY, impostor)] = cache.entries[cache.key(ROOT_KEY, prompt)]
    assert cache.lookup(impostor + [0], 17).n_tokens == 0
    assert cache.lookup(prompt + [0], 17).n_tokens == 16


def test_duplicate_prefixes_keep_the_first_block():
    pool = BlockPool(8)
    cache = PrefixCache(pool, "model")
    a, keys_a = fill(cache, pool, tokens(0, 1))
    b, keys_b = fill(cache, pool, tokens(0, 1))
    assert keys_a == keys_b and cache.n_cached_blocks == 1
    b.release_all(pool)
    assert pool.n_free == 8 - 1       # the duplicate was never cached: it is free again at once


def state(value: float) -> RecurrentState:
    s = RecurrentState(1, 4, 4, 1, 2, 2)
    s.conv.fill(value)
    s.ssm.fill(value)
    return s


def test_hybrid_hits_end_on_snapshots():
    pool = BlockPool(16)
    cache = PrefixCache(pool, "model", recurrent=True, snapshot_cost_blocks=2)
    prompt = tokens(0, 4)
    table, keys = fill(cache, pool, prompt)
    assert cache.lookup(prompt + [1], 65).n_tokens == 0        # no snapshot, no hit
    assert cache.add_snapshot(keys[1], state(2.0))
    hit = cache.lookup(prompt + [1], 65)
    assert hit.n_tokens == 32 and hit.blocks == [int(b) for b in table.ids[:2]]
    assert np.all(hit.snapshot.ssm == 2.0)
    assert cache.add_snapshot(keys[3], state(4.0))
    assert cache.lookup(prompt + [1], 65).n_tokens == 64
    assert cache.lookup(prompt + [1], 63).n_tokens == 32       # capped below the last snapshot: fall back
    assert pool.n_used == 4 + 2 * 2                            # snapshots are charged against the pool


def test_evicting_a_block_drops_its_snapshot_and_returns_the_charge():
    pool = BlockPool(6)
    cache = PrefixCache(pool, "model", recurrent=True, snapshot_cost_blocks=2)
    table, keys = fill(cache, pool, tokens(0, 1))
    assert cache.add_snapshot(keys[0], state(1.0))
    table.release_all(pool)
    assert pool.n_used == 2
    held = [pool.allocate() for _ in range(4)]           # four: three free, then the cached block is evicted
    assert cache.n_cached_blocks == 0 and not cache.snapshots
    assert pool.n_free == 2                              # the snapshot's charge came back
    for block in held:
        pool.release(block)


def test_snapshot_without_room_is_skipped():
    pool = BlockPool(3)
    cache = PrefixCache(pool, "model", recurrent=True, snapshot_cost_blocks=4)
    _, keys = fill(cache, pool, tokens(0, 1))
    assert not cache.add_snapshot(keys[0], state(1.0))
    assert pool.n_used == 1


def test_snapshots_can_be_dropped_to_make_room():
    pool = BlockPool(9)
    cache = PrefixCache(pool, "model", recurrent=True, snapshot_cost_blocks=2)
    _, keys = fill(cache, pool, tokens(0, 3))
    for key in keys:
        assert cache.add_snapshot(key, state(1.0))
    assert pool.n_available == 0 and cache.snapshot_blocks == 6
    cache.drop_snapshots_until(3)
    assert pool.n_available == 4 and len(cache.snapshots) == 1 and keys[2] in cache.snapshots


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 40, 48, 100])
def test_common_prefix_finds_the_first_difference_across_block_boundaries(n: int):
    a = list(range(100))
    b = a[:n] + [-1] + a[n + 1:]
    assert common_prefix(a, b) == n
    assert common_prefix(a[:n], a) == common_prefix(a, a[:n]) == n
    assert common_prefix(a, list(a)) == 100
