"""Embeddings: the last hidden states of token lists, pooled into one L2-normalised vector each.

Each token list runs as a fresh scratch sequence whose KV lives in a `ModelRunner.scratch_space` and is
released afterwards, so no slot, cached block or recurrent state is touched. Short lists are packed into
one forward of at most the token budget, a long one is fed in chunks of it; the kernels give a row the
same result whatever the batch or chunk split, so an input's vector does not depend on its neighbours.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from basert.engine.kv import blocks_for
from basert.engine.runner import ContextOverflowError, ForwardRequest, ModelRunner
from basert.errors import InvalidRequestError

# How a sequence's hidden states [n, hidden] become one vector, in float64; cls is the first token's state.
POOLINGS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "mean": lambda states: states.mean(axis=0, dtype=np.float64),
    "last": lambda states: states[-1].astype(np.float64),
    "cls": lambda states: states[0].astype(np.float64),
}


class EmbeddingInputError(InvalidRequestError, ValueError):
    """An input that cannot be embedded: empty, or with token ids outside the vocabulary."""

    param = "input"


def check_inputs(token_lists: Sequence[Sequence[int]], vocab_size: int, max_context: int) -> None:
    """Raise for the first input that cannot be embedded (none at all, empty, too long, bad ids)."""
    if not token_lists:
        raise EmbeddingInputError("input must not be empty")
    for index, tokens in enumerate(token_lists):
        if not tokens:
            raise EmbeddingInputError(f"input[{index}] is empty (no tokens)")
        if len(tokens) > max_context:
            error = ContextOverflowError(len(tokens), max_context)
            error.param = "input"
            raise error
        if min(tokens) < 0 or max(tokens) >= vocab_size:
            raise EmbeddingInputError(f"input[{index}] has token ids outside [0, {vocab_size})")


def input_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Indices of the inputs, in order, grouped so that each group is one input longer than the budget
    or several whose lengths add up to at most the budget."""
    batches: list[list[int]] = []
    used = token_budget
    for index, length in enumerate(lengths):
        if used + length > token_budget:
            batches.append([])
            used = 0
        batches[-1].append(index)
        used += length
    return batches


def hidden_states(runner: ModelRunner, token_lists: Sequence[Sequence[int]], token_budget: int) -> list[np.ndarray]:
    """The final norm's output at every position of each token list run as a fresh sequence, [n_i, hidden]
    float32; the forwards feed at most token_budget tokens each."""
    space = runner.scratch_space(sum(blocks_for(len(tokens)) for tokens in token_lists),
                                 sum(runner.window_blocks_for(len(tokens), token_budget) for tokens in token_lists))
    sequences = [runner.new_sequence() for _ in token_lists]
    states = [np.empty((len(tokens), runner.hidden_size), dtype=np.float32) for tokens in token_lists]
    try:
        while True:
            fed, room = [], token_budget
            for index, tokens in enumerate(token_lists):
                take = min(len(tokens) - sequences[index].n_past, room)
                if take > 0:
                    fed.append((index, sequences[index].n_past, take))
                    room -= take
            if not fed:
                return states
            requests = [ForwardRequest(sequences[i], token_lists[i][start: start + take], "all")
                        for i, start, take in fed]
            for (i, start, take), rows in zip(fed, runner.forward(requests, hidden=True, space=space)):
                states[i][start: start + take] = rows
    finally:
        for sequence in sequences:
            sequence.reset(space.pool, space.window_pool)


def pooled(states: np.ndarray, pooling: str) -> np.ndarray:
    """One sequence's hidden states [n, hidden] pooled (a name of POOLINGS) and L2-normalised, float32."""
    vector = POOLINGS[pooling](states)
    norm = np.sqrt(np.dot(vector, vector))
    return (vector / norm if norm > 0 else vector).astype(np.float32)
