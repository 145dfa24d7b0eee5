"""Prefix cache: full KV blocks found again through a hash chain over their tokens, plus hybrid snapshots.

A block's key is `xxh64(parent key, its 16 tokens, model fingerprint)`, so a key names the whole prefix up
to the block's end. Blocks are registered as soon as they are full and are shared read-only (a slot writes
only into blocks it owns; see `BlockPool.is_shared`). Unreferenced cached blocks wait in the pool's LRU
queue and are evicted oldest first. Every hit is checked against the stored tokens and parent key, so a
hash collision can never hand out the wrong KV.

Sliding-window layers keep their KV in a pool of their own (see kv.py): a cached block's key may also name
the block of those layers at the same positions, and a hit only ends where the window layers' blocks that its
next token reads are all cached. Those blocks wait in their pool's LRU queue as the others do; evicting one
leaves its key's other block cached (a longer hit may still need it in the middle of its prefix).

Hybrid models also need the recurrent (DeltaNet) state at the hit's end: snapshots are stored per key, and
a hit only ends where one is stored. A snapshot is charged against the same budget as the KV: it holds
as many pool blocks as its bytes would fill, released when its block is evicted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

from basert.engine.kv import BLOCK_SIZE, NO_BLOCK, BlockPool, window_start
from basert.engine.sequence import RecurrentState

ROOT_KEY = 0


def block_key(parent: int, tokens: Sequence[int], fingerprint: bytes) -> int:
    """The key of a block of `tokens` after the prefix named `parent` (ROOT_KEY for the first block)."""
    digest = xxhash.xxh64()
    digest.update(parent.to_bytes(8, "little"))
    digest.update(np.asarray(tokens, dtype=np.int32).tobytes())
    digest.update(fingerprint)
    return digest.intdigest()


def chain_keys(tokens: Sequence[int], fingerprint: bytes) -> list[int]:
    """The keys of every full block of `tokens`, in order: key i names the first 16 (i + 1) tokens."""
    keys: list[int] = []
    parent = ROOT_KEY
    for start in range(0, len(tokens) - BLOCK_SIZE + 1, BLOCK_SIZE):
        parent = block_key(parent, tokens[start: start + BLOCK_SIZE], fingerprint)
        keys.append(parent)
    return keys


@dataclass(frozen=True, slots=True)
class CachedBlock:
    block: int
    parent: int
    tokens: tuple[int, ...]


@dataclass(slots=True)
class StoredSnapshot:
    state: RecurrentState
    charged_blocks: list[int]


@dataclass(slots=True)
class CacheHit:
    """The longest usable cached prefix: its blocks, their keys, the window layers' blocks its next token reads
    (NO_BLOCK before them), and (hybrids) the state at its end."""

    n_tokens: int = 0
    blocks: list[int] = field(default_factory=list)
    window_blocks: list[int] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)
    snapshot: RecurrentState | None = None


class PrefixCache:
    """Hash chain over full blocks of one model's KV pool."""

    def __init__(self, pool: BlockPool, fingerprint: str, *, recurrent: bool = False,
                 snapshot_cost_blocks: int = 1, window_pool: BlockPool | None = None, window: int = 0):
        """window_pool and window: the sliding-window layers' pool and their widest window (models with such
        layers)."""
        self.pool = pool
        self.window_pool = window_pool if window else None
        self.window = window if window_pool is not None else 0
        self.fingerprint = fingerprint.encode()
        self.recurrent = recurrent
        self.snapshot_cost_blocks = max(1, snapshot_cost_blocks)
        self.entries: dict[int, CachedBlock] = {}
        self.key_of_block: dict[int, int] = {}
        self.snapshots: dict[int, StoredSnapshot] = {}
        self.window_block_of: dict[int, int] = {}   # key -> its window layers' block
        self.key_of_window_block: dict[int, int] = {}
        self.queries = 0
        self.query_tokens = 0
        self.hit_tokens = 0
        self.version = 0          # grows whenever a block or snapshot is added: a lookup may now hit more
        pool.on_evict = self._forget
        if self.window_pool is not None:
            self.window_pool.on_evict = self._forget_window_block

    def key(self, parent: int, tokens: Sequence[int]) -> int:
        return block_key(parent, tokens, self.fingerprint)

    # --- lookup -------------------------------------------------------------------------------
    def lookup(self, tokens: Sequence[int], limit: int, *, count: bool = True) -> CacheHit:
        """The longest cached prefix of `tokens` of at most `limit` tokens (hybrids: ending on a snapshot; window
        layers: with the blocks its next token reads).

        Counts as one query unless `count` is false; the hit's blocks are not retained (the caller adopts them).
        """
        if count:
            self.queries += 1
            self.query_tokens += len(tokens)
        hit = CacheHit()
        parent = ROOT_KEY
        blocks: list[int] = []
        keys: list[int] = []
        window_from = 0    # window blocks are cached for every key from this one on
        for start in range(0, limit - BLOCK_SIZE + 1, BLOCK_SIZE):
            chunk = tuple(tokens[start: start + BLOCK_SIZE])
            key = self.key(parent, chunk)
            entry = self.entries.get(key)
            if entry is None or entry.parent != parent or entry.tokens != chunk:
                break
            blocks.append(entry.block)
            keys.append(key)
            parent = key
            n_tokens = len(blocks) * BLOCK_SIZE
            if self.window:
                if key not in self.window_block_of:
                    window_from = len(blocks)
                if window_from > window_start(n_tokens, self.window):
                    continue
            if not self.recurrent:
                hit.n_tokens = n_tokens
            elif key in self.snapshots:
                hit.n_tokens = n_tokens
                hit.snapshot = self.snapshots[key].state
        n_blocks = hit.n_tokens // BLOCK_SIZE
        hit.blocks = blocks[:n_blocks]
        hit.keys = keys[:n_blocks]
        if self.window:
            first = window_start(hit.n_tokens, self.window)
            hit.window_blocks = [NO_BLOCK] * first + [self.window_block_of[key] for key in hit.keys[first:]]
        return hit

    def count_hit(self, n_tokens: int) -> None:
        self.hit_tokens += n_tokens

    # --- filling ------------------------------------------------------------------------------
    def register(self, parent: int, tokens: Sequence[int], block: int, window_block: int = NO_BLOCK) -> int:
        """A full block's key; the block (and the window layers' block at its positions, when given) becomes
        shareable unless the same prefix is cached already."""
        chunk = tuple(tokens)
        if len(chunk) != BLOCK_SIZE:
            raise ValueError(f"only full blocks of {BLOCK_SIZE} tokens are cached")
        key = self.key(parent, chunk)
        if key not in self.entries and block not in self.key_of_block:
            self.entries[key] = CachedBlock(block, parent, chunk)
            self.key_of_block[block] = key
            self.pool.cached.add(block)
            self.version += 1
        if (self.window_pool is not None and window_block != NO_BLOCK and key in self.entries
                and key not in self.window_block_of and window_block not in self.key_of_window_block):
            self.window_block_of[key] = window_block
            self.key_of_window_block[window_block] = key
            self.window_pool.cached.add(window_block)
            self.version += 1
        return key

    def add_snapshot(self, key: int, state: RecurrentState) -> bool:
        """Store the recurrent state at the end of the block with this key (False: no room or no such block)."""
        if key in self.snapshots:
            return True
        if key not in self.entries or self.pool.n_available < self.snapshot_cost_blocks:
            return False
        charged = [self.pool.allocate() for _ in range(self.snapshot_cost_blocks)]
        if key not in self.entries:  # the allocation evicted the block itself
            for block in charged:
                self.pool.release(block)
            return False
        self.snapshots[key] = StoredSnapshot(state.clone(), charged)
        self.version += 1
        return True

    @property
    def snapshot_blocks(self) -> int:
        """Pool blocks charged for the stored snapshots (all reclaimable by dropping snapshots)."""
        return sum(len(stored.charged_blocks) for stored in self.snapshots.values())

    def drop_snapshots_until(self, n_available: int) -> None:
        """Drop snapshots, oldest first, until the pool has n_available blocks (or none is left)."""
        while self.snapshots and self.pool.n_available < n_available:
            key = next(iter(self.snapshots))
            for charged in self.snapshots.pop(key).charged_blocks:
                self.pool.release(charged)

    def _forget(self, block: int) -> None:
        """The pool evicted a cached block: drop its key and its snapshot."""
        key = self.key_of_block.pop(block, None)
        if key is None:
            return
        del self.entries[key]
        window_block = self.window_block_of.pop(key, None)
        if window_block is not None:
            del self.key_of_window_block[window_block]
            self.window_pool.uncache(window_block)
        stored = self.snapshots.pop(key, None)
        if stored is not None:
            for charged in stored.charged_blocks:
                self.pool.release(charged)

    def _forget_window_block(self, window_block: int) -> None:
        """The window pool evicted a cached block: its key keeps its other block."""
        key = self.key_of_window_block.pop(window_block, None)
        if key is not None:
            del self.window_block_of[key]

    # --- reporting ----------------------------------------------------------------------------
    @property
    def n_cached_blocks(self) -> int:
        return len(self.entries)

    def stats(self) -> dict:
        return {
            "queries": self.queries,
            "query_tokens": self.query_tokens,
            "hit_tokens": self.hit_tokens,
            "blocks_cached": len(self.entries),
            "blocks_used": self.pool.n_used,
            "snapshots": len(self.snapshots),
        }
