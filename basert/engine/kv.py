"""KV blocks: a pool that only counts blocks, the per-layer K/V tensors, and per-sequence block tables."""

from __future__ import annotations

import numpy as np

BLOCK_SIZE = 16


class OutOfBlocksError(RuntimeError):
    """The KV pool has no free block left for a sequence that needs one."""


def blocks_for(n_tokens: int) -> int:
    """Number of blocks needed to hold n_tokens positions."""
    return (n_tokens + BLOCK_SIZE - 1) // BLOCK_SIZE


class BlockPool:
    """Free list and reference counts of block ids; holds no tensors."""

    def __init__(self, n_blocks: int):
        self.n_blocks = n_blocks
        self.ref_counts = np.zeros(n_blocks, dtype=np.int32)
        # Pop from the end: lowest ids are handed out first, which keeps small runs contiguous.
        self.free_ids = list(range(n_blocks - 1, -1, -1))

    @property
    def n_free(self) -> int:
        return len(self.free_ids)

    def allocate(self) -> int:
        """A fresh block with reference count 1."""
        if not self.free_ids:
            raise OutOfBlocksError(f"all {self.n_blocks} KV blocks are in use")
        block = self.free_ids.pop()
        self.ref_counts[block] = 1
        return block

    def retain(self, block: int) -> None:
        """One more holder of a block."""
        if self.ref_counts[block] <= 0:
            raise ValueError(f"block {block} is not allocated")
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        """One holder fewer; the block returns to the free list at zero."""
        if self.ref_counts[block] <= 0:
            raise ValueError(f"block {block} released more often than allocated")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_ids.append(block)


class KVCache:
    """K and V of every attention layer, shaped [n_blocks, n_kv_heads, BLOCK_SIZE, head_dim]."""

    def __init__(self, n_layers: int, n_blocks: int, n_kv_heads: int, head_dim: int, dtype: np.dtype):
        if np.dtype(dtype) not in (np.dtype(np.float16), np.dtype(np.float32)):
            raise ValueError(f"KV element type must be float16 or float32, not {dtype}")
        shape = (n_blocks, n_kv_heads, BLOCK_SIZE, head_dim)
        self.k = [np.zeros(shape, dtype=dtype) for _ in range(n_layers)]
        self.v = [np.zeros(shape, dtype=dtype) for _ in range(n_layers)]
        self.n_blocks = n_blocks

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)


class BlockTable:
    """The blocks that hold one sequence's KV, in position order (a reusable int32 array)."""

    def __init__(self, max_blocks: int):
        self.ids = np.zeros(max_blocks, dtype=np.int32)
        self.n_blocks = 0

    @property
    def capacity_tokens(self) -> int:
        return self.n_blocks * BLOCK_SIZE

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

    def truncate(self, n_tokens: int, pool: BlockPool) -> None:
        """Keep only the blocks covering the first n_tokens positions."""
        keep = blocks_for(n_tokens)
        while self.n_blocks > keep:
            self.n_blocks -= 1
            pool.release(int(self.ids[self.n_blocks]))

    def release_all(self, pool: BlockPool) -> None:
        self.truncate(0, pool)
