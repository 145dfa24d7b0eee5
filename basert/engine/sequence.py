"""One sequence's state in the engine: computed tokens, KV block table, recurrent (DeltaNet) state."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from basert.engine.kv import BlockPool, BlockTable


class RecurrentState:
    """Per-sequence Gated DeltaNet state of every linear-attention layer, float32.

    conv[l] holds the last K-1 conv inputs [conv_dim, K-1]; ssm[l] is S [n_v, d_k, d_v].
    It cannot be rewound, only reset, copied or restored.
    """

    def __init__(self, n_layers: int, conv_dim: int, conv_width: int, n_v: int, d_k: int, d_v: int):
        self.conv = np.zeros((n_layers, conv_dim, conv_width - 1), dtype=np.float32)
        self.ssm = np.zeros((n_layers, n_v, d_k, d_v), dtype=np.float32)

    def reset(self) -> None:
        self.conv.fill(0.0)
        self.ssm.fill(0.0)

    def clone(self) -> RecurrentState:
        copy = RecurrentState.__new__(RecurrentState)
        copy.conv = self.conv.copy()
        copy.ssm = self.ssm.copy()
        return copy

    def copy_from(self, other: RecurrentState) -> None:
        np.copyto(self.conv, other.conv)
        np.copyto(self.ssm, other.ssm)


@dataclass(slots=True)
class SequenceState:
    """Everything the forward pass needs to continue one sequence."""

    block_table: BlockTable
    recurrent: RecurrentState | None
    tokens: list[int]          # tokens whose KV / state have been computed, in order
    block_keys: list[int] = field(default_factory=list)  # prefix-cache keys of the full blocks, in order

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def reset(self, pool: BlockPool) -> None:
        """Forget everything: release the blocks and zero the recurrent state."""
        self.block_table.release_all(pool)
        if self.recurrent is not None:
            self.recurrent.reset()
        self.tokens.clear()
        self.block_keys.clear()
