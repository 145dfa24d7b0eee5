"""ModelInfo: the facts about a loaded model that the layers above the engine may read.

The server, the CLI and the Python API read these instead of reaching into the engine's runner, slots or
caches, so the engine can change its insides without breaking them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What a served model is and what it can do, fixed when its engine is built."""

    id: str                      # the name clients use (org/name for installed models)
    path: Path                   # the .base file
    arch: str                    # the header's architecture, e.g. "llama", "qwen35"
    vocab_size: int
    n_ctx: int                   # the context window of each slot, in tokens
    fingerprint: str             # xxh64 of the .base header: changes with any weight or config change
    hybrid: bool                 # has recurrent (Gated DeltaNet) layers: state is kept at chat-segment ends
    n_slots: int
    hidden_size: int             # the width of the last hidden states: the size of an embedding
    n_keep: int = 0              # with context shift: the prompt tokens a shift keeps by default (-1: all)
    pooling: str = "mean"        # how Engine.embed pools a sequence's hidden states by default: mean, last, cls
    n_ctx_train: int | None = None  # the context the model was trained on, if its file says
    warnings: tuple[str, ...] = ()  # what an operator should know about how it is served (a context beyond n_ctx_train)
    features: frozenset[str] = frozenset()  # "continuous_batching", "paged_kv", "prefix_cache", "prefix_cache_file",
                                            # "context_shift"

    def has(self, feature: str) -> bool:
        return feature in self.features
