"""KV blocks: a pool of block ids with reference counts, the per-layer K/V tensors, and per-sequence block tables.

A block whose last holder lets go returns to the free list, unless the prefix cache registered it:
then it waits in an LRU queue, still holding its KV, until a hit revives it or an allocation evicts it.

Sliding-window layers (a token sees the last `window` positions only) keep their K/V in blocks of a second,
smaller pool: a sequence's window table holds the blocks of its last positions only. After each forward the
blocks wholly before what the next token's window (less WINDOW_SLACK positions, so that a conversation can
resume a little before its end) reads are released; their table entries become NO_BLOCK, which no kernel reads.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from basert._ext.kvtypes import KVType
from basert.errors import UnavailableError

BLOCK_SIZE = 16
NO_BLOCK = -1           # a window table's entry for a block released because no window reads it any more
# Positions before a sequence's window whose window-layer KV it keeps: a history cut back by up to this many
# tokens (a request that shares all but the end of a slot's history) still resumes without recomputing.
WINDOW_SLACK = 256


class OutOfBlocksError(UnavailableError, RuntimeError):
    """The KV pool has no free block left for a sequence that needs one; running requests free theirs soon."""

    code = "kv_cache_full"
    retry_after = 1

    def client_message(self) -> str:
        return f"the KV cache is full ({self}); retry when running requests finish"


def blocks_for(n_tokens: int) -> int:
    """Number of blocks needed to hold n_tokens positions."""
    return (n_tokens + BLOCK_SIZE - 1) // BLOCK_SIZE


def window_start(n_past: int, window: int) -> int:
    """The first block a sliding window of `window` positions reads when the token at position n_past is computed
    (the block of position n_past + 1 - window)."""
    return max(0, n_past + 1 - window) // BLOCK_SIZE


def window_blocks(window: int, n_tokens: int) -> int:
    """The most window blocks a sequence holds while it computes a chunk of n_tokens (its window, the slack and
    the chunk, each maybe starting inside a block)."""
    return blocks_for(window + WINDOW_SLACK + n_tokens) + 2


def window_pool_blocks(window: int, n_sequences: int, token_budget: int, max_context: int) -> int:
    """Blocks of the window pool that n_sequences sequences of at most max_context tokens never run out of when
    each step feeds at most token_budget tokens in all: each sequence's window and slack, and the step's chunks
    (never more than every position of every sequence); 0 without a window."""
    if not window:
        return 0
    return min(n_sequences * (window_blocks(window, 0) + 2) + blocks_for(token_budget),
               n_sequences * blocks_for(max_context))


class BlockPool:
    """Free list, reference counts and the LRU queue of unreferenced cached blocks; holds no tensors."""

    def __init__(self, n_blocks: int):
        self.n_blocks = n_blocks
        self.ref_counts = np.zeros(n_blocks, dtype=np.int32)
        # Pop from the end: lowest ids are handed out first, which keeps small runs contiguous.
        self.free_ids = list(range(n_blocks - 1, -1, -1))
        self.cached: set[int] = set()                       # blocks whose KV the prefix cache can hand out
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, oldest first
        self.on_evict: Callable[[int], None] | None = None

    @property
    def n_free(self) -> int:
        return len(self.free_ids)

    @property
    def n_available(self) -> int:
        """Blocks an allocation can get: free ones plus unreferenced cached ones (evicted oldest first)."""
        return len(self.free_ids) + len(self.evictable)

    @property
    def n_used(self) -> int:
        return self.n_blocks - self.n_available

    def allocate(self) -> int:
        """A block for exclusive writing, with reference count 1."""
        if self.free_ids:
            block = self.free_ids.pop()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)
            self.cached.discard(block)
            if self.on_evict is not None:
                self.on_evict(block)
        else:
            raise OutOfBlocksError(f"all {self.n_blocks} KV blocks are in use")
        self.ref_counts[block] = 1
        return block

    def retain(self, block: int) -> None:
        """One more holder of a block (a cached block nobody held comes back from the LRU queue)."""
        if self.ref_counts[block] <= 0:
            if block not in self.evictable:
                raise ValueError(f"block {block} is not allocated")
            del self.evictable[block]
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        """One holder fewer; at zero a cached block joins the LRU queue, any other the free list."""
        if self.ref_counts[block] <= 0:
            raise ValueError(f"block {block} released more often than allocated")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if block in self.cached:
                self.evictable[block] = None
            else:
                self.free_ids.append(block)

    def uncache(self, block: int) -> None:
        """The prefix cache lets go of a block: unreferenced, it is free again."""
        self.cached.discard(block)
        if block in self.evictable:
            del self.evictable[block]
            self.free_ids.append(block)

    def is_shared(self, block: int) -> bool:
        """Whether writing into the block could change what someone else reads."""
        return self.ref_counts[block] > 1 or block in self.cached


class KVCache:
    """K and V of every attention layer, shaped [n_blocks, n_kv_heads, BLOCK_SIZE, row] with rows of head_dim
    values stored as the K and the V type (basert._ext.kvtypes). A sliding-window layer's arrays have
    n_window_blocks blocks (the window pool's), every other layer's n_blocks."""

    def __init__(self, windows: list[int], n_blocks: int, n_window_blocks: int, n_kv_heads: int, head_dim: int,
                 k_type: KVType, v_type: KVType):
        """windows: each attention layer's sliding window in positions, 0 for a layer that sees every position."""
        k_type.require(head_dim)
        v_type.require(head_dim)
        self.windows = list(windows)
        self.window = max(self.windows, default=0)   # the widest window (0: no window layer)
        self.n_blocks = n_blocks
        self.n_window_blocks = n_window_blocks if self.window else 0

        # Written once now, not lazily on first use: the pool's memory is taken at start, so a server that
        # cannot hold it fails before it serves, and its resident size does not creep up under load.
        def arrays(kind: KVType) -> list[np.ndarray]:
            return [np.full((self.n_window_blocks if window else n_blocks, n_kv_heads, BLOCK_SIZE,
                             kind.row_units(head_dim)), 0, dtype=kind.storage) for window in self.windows]

        self.k, self.v = arrays(k_type), arrays(v_type)
        self.k_type, self.v_type = k_type, v_type

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block over the layers that see every position, K and V."""
        total = sum(k.nbytes + v.nbytes for k, v, window in zip(self.k, self.v, self.windows) if not window)
        return total // self.n_blocks if self.n_blocks else 0

    def copy_block(self, source: int, target: int, *, windowed: bool = False) -> None:
        """Copy a block of the layers that see every position (windowed: of the sliding-window layers)."""
        for k, v, window in zip(self.k, self.v, self.windows):
            if bool(window) == windowed:
                k[target] = k[source]
                v[target] = v[source]


@dataclass(frozen=True, slots=True)
class KVSpace:
    """The block pools and the K/V tensors their block ids index: the runner's shared ones, or private ones that
    hold scratch sequences' KV (see `ModelRunner.scratch_space`). window_pool is None without window layers."""

    pool: BlockPool
    window_pool: BlockPool | None
    cache: KVCache


class BlockTable:
    """The blocks that hold one sequence's KV, in position order (a reusable int32 array). A window table's first
    entries may be NO_BLOCK: blocks before the window were released (`release_before`)."""

    def __init__(self, max_blocks: int):
        self.ids = np.zeros(max_blocks, dtype=np.int32)
        self.n_blocks = 0
        self.first = 0      # the first entry that names a block (entries before it are NO_BLOCK)

    def view(self) -> np.ndarray:
        return self.ids[: self.n_blocks]

    def held(self) -> np.ndarray:
        """The blocks the table holds, in position order."""
        return self.ids[self.first: self.n_blocks]

    def ensure(self, n_tokens: int, pool: BlockPool) -> None:
        """Allocate blocks until n_tokens positions fit."""
        needed = blocks_for(n_tokens)
        if needed > len(self.ids):
            raise OutOfBlocksError(f"{n_tokens} tokens need {needed} blocks; a sequence holds at most {len(self.ids)}")
        while self.n_blocks < needed:
            self.ids[self.n_blocks] = pool.allocate()
            self.n_blocks += 1

    def adopt(self, blocks: list[int], pool: BlockPool) -> None:
        """Start from shared blocks (a prefix-cache hit), NO_BLOCK entries included: each gets one more holder."""
        if self.n_blocks:
            raise ValueError("adopt needs an empty block table")
        for block in blocks:
            if block != NO_BLOCK:
                pool.retain(block)
            elif self.first == self.n_blocks:
                self.first += 1
            else:
                raise ValueError("a block table's NO_BLOCK entries must come first")
            self.ids[self.n_blocks] = block
            self.n_blocks += 1

    def start_at(self, first: int) -> None:
        """An empty table's first `first` entries become NO_BLOCK (a window table restored from its window)."""
        if self.n_blocks:
            raise ValueError("start_at needs an empty block table")
        self.ids[:first] = NO_BLOCK
        self.n_blocks = self.first = first

    def release_before(self, first: int, pool: BlockPool) -> None:
        """Release the blocks before entry `first` (a window table: no window reads them any more)."""
        first = min(first, self.n_blocks)
        while self.first < first:
            pool.release(int(self.ids[self.first]))
            self.ids[self.first] = NO_BLOCK
            self.first += 1

    def truncate(self, n_tokens: int, pool: BlockPool) -> None:
        """Keep only the blocks covering the first n_tokens positions."""
        keep = blocks_for(n_tokens)
        while self.n_blocks > keep:
            self.n_blocks -= 1
            if self.n_blocks >= self.first:
                pool.release(int(self.ids[self.n_blocks]))
        self.first = min(self.first, self.n_blocks)

    def release_all(self, pool: BlockPool) -> None:
        self.truncate(0, pool)
