"""KV blocks: a pool of block ids with reference counts, the per-layer K/V tensors, and per-sequence block tables.

A block whose last holder lets go returns to the free list, unless the prefix cache registered it:
then it waits in an LRU queue, still holding its KV, until a hit revives it or an allocation evicts it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from basert._ext.kvtypes import KVType
from basert.errors import UnavailableError

BLOCK_SIZE = 16


class OutOfBlocksError(UnavailableError, RuntimeError):
    """The KV pool has no free block left for a sequence that needs one; running requests free theirs soon."""

    code = "kv_cache_full"
    retry_after = 1

    def client_message(self) -> str:
        return f"the KV cache is full ({self}); retry when running requests finish"


def blocks_for(n_tokens: int) -> int:
    """Number of blocks needed to hold n_tokens positions."""
    return (n_tokens + BLOCK_SIZE - 1) // BLOCK_SIZE


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

    def is_shared(self, block: int) -> bool:
        """Whether writing into the block could change what someone else reads."""
        return self.ref_counts[block] > 1 or block in self.cached


class KVCache:
    """K and V of every attention layer, shaped [n_blocks, n_kv_heads, BLOCK_SIZE, row] with rows of head_dim
    values stored as the K and the V type (basert._ext.kvtypes)."""

    def __init__(self, n_layers: int, n_blocks: int, n_kv_heads: int, head_dim: int, k_type: KVType, v_type: KVType):
        k_type.require(head_dim)
        v_type.require(head_dim)
        # Written once now, not lazily on first use: the pool's memory is taken at start, so a server that
        # cannot hold it fails before it serves, and its resident size does not creep up under load.
        self.k = [np.full((n_blocks, n_kv_heads, BLOCK_SIZE, k_type.row_units(head_dim)), 0, dtype=k_type.storage)
                  for _ in range(n_layers)]
        self.v = [np.full((n_blocks, n_kv_heads, BLOCK_SIZE, v_type.row_units(head_dim)), 0, dtype=v_type.storage)
                  for _ in range(n_layers)]
        self.n_blocks = n_blocks
        self.k_type, self.v_type = k_type, v_type

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block over all layers, K and V."""
        return self.nbytes // self.n_blocks if self.n_blocks else 0

    def copy_block(self, source: int, target: int) -> None:
        for cache in (*self.k, *self.v):
            cache[target] = cache[source]


@dataclass(frozen=True, slots=True)
class KVSpace:
    """A block pool and the K/V tensors its block ids index: the runner's shared one, or a private one that
    holds a scratch sequence's KV (see `ModelRunner.scratch_space`)."""

    pool: BlockPool
    cache: KVCache


class BlockTable:
    """The blocks that hold one sequence's KV, in position order (a reusable int32 array)."""

    def __init__(self, max_blocks: int):
        self.ids = np.zeros(max_blocks, dtype=np.int32)
        self.n_blocks = 0

    def view(self) -> np.ndarray:
        return self.ids[: self.n_blocks]

    def ensure(self, n_tokens: int, pool: BlockPool) -> None:
        """Allocate blocks until n_tokens positions fit."""
        needed = blocks_for(n_tokens)
        if needed > len(self.ids):
            raise OutOfBlocksError(f"{n_tokens} tokens need {needed} blocks; a sequence holds at most {len(self.ids)}")
        while self.n_blocks < needed:
            self.ids[self.n_blocks] = pool.allocate()
            self.n_blocks += 1

    def adopt(self, blocks: list[int], pool: BlockPool) -> None:
        """Start from shared blocks (a prefix-cache hit): each gets one more holder."""
        if self.n_blocks:
            raise ValueError("adopt needs an empty block table")
        for block in blocks:
            pool.retain(block)
            self.ids[self.n_blocks] = block
            self.n_blocks += 1

    def truncate(self, n_tokens: int, pool: BlockPool) -> None:
        """Keep only the blocks covering the first n_tokens positions."""
        keep = blocks_for(n_tokens)
        while self.n_blocks > keep:
            self.n_blocks -= 1
            pool.release(int(self.ids[self.n_blocks]))

    def release_all(self, pool: BlockPool) -> None:
        self.truncate(0, pool)
