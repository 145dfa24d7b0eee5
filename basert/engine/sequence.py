"""One sequence's state in the engine: computed tokens, KV block table, recurrent (DeltaNet) state."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from basert.engine.kv import BlockPool, BlockTable

RECURRENT_DTYPE = np.dtype(np.float32)


class RecurrentState:
    """Per-sequence Gated DeltaNet state of every linear-attention layer, float32.

    conv[l] holds the last K-1 conv inputs [conv_dim, K-1]; ssm[l] is S [n_v, d_k, d_v].
    It cannot be rewound, only reset, copied or restored.
    """

    def __init__(self, n_layers: int, conv_dim: int, conv_width: int, n_v: int, d_k: int, d_v: int):
        self.conv = np.zeros((n_layers, conv_dim, conv_width - 1), dtype=RECURRENT_DTYPE)
        self.ssm = np.zeros((n_layers, n_v, d_k, d_v), dtype=RECURRENT_DTYPE)

    @classmethod
    def zeros(cls, conv_shape: tuple[int, ...], ssm_shape: tuple[int, ...]) -> RecurrentState:
        """A zeroed state of these shapes (see `ModelRunner.recurrent_shapes`)."""
        return cls._of(np.zeros(conv_shape, dtype=RECURRENT_DTYPE), np.zeros(ssm_shape, dtype=RECURRENT_DTYPE))

    @classmethod
    def _of(cls, conv: np.ndarray, ssm: np.ndarray) -> RecurrentState:
        state = cls.__new__(cls)
        state.conv = conv
        state.ssm = ssm
        return state

    def reset(self) -> None:
        self.conv.fill(0.0)
        self.ssm.fill(0.0)

    def clone(self) -> RecurrentState:
        return RecurrentState._of(self.conv.copy(), self.ssm.copy())

    def copy_from(self, other: RecurrentState) -> None:
        self.assign(other.conv, other.ssm)

    def assign(self, conv: np.ndarray, ssm: np.ndarray) -> None:
        """Overwrite the state with these values (of the state's shapes)."""
        np.copyto(self.conv, conv)
        np.copyto(self.ssm, ssm)


@dataclass(slots=True)
class SequenceState:
    """Everything the forward pass needs to continue one sequence."""

    block_table: BlockTable
    recurrent: RecurrentState | None
    tokens: list[int]          # tokens whose KV / state have been computed, in order
    block_keys: list[int] = field(default_factory=list)  # prefix-cache keys of the full blocks, in order
    window_table: BlockTable | None = None  # the sliding-window layers' blocks (models with such layers)

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def reset(self, pool: BlockPool, window_pool: BlockPool | None = None) -> None:
        """Forget everything: release the blocks (the window table's to window_pool) and zero the recurrent state."""
        self.block_table.release_all(pool)
        if self.window_table is not None:
            self.window_table.release_all(window_pool)
        if self.recurrent is not None:
            self.recurrent.reset()
        self.tokens.clear()
        self.block_keys.clear()
