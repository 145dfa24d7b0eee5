"""Embeddings: the last hidden states of token lists, pooled into one L2-normalised vector each.

Each token list runs as a fresh scratch sequence whose KV lives in a `ModelRunner.scratch_space` and is
released afterwards, so no slot, cached block or recurrent state is touched. Short lists are packed into
one forward of at most the token budget, a long one is fed in chunks of it; the kernels give a row the
same result whatever the batch or chunk split, so an input's vector does not depend on its neighbours.
"""

from __future__ import annotations

from collections import deque
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


class EmbeddingRun:
    """The final norm's output at every position of each token list run as a fresh sequence, [n_i, hidden]
    float32 in `states`, computed one forward of at most `token_budget` tokens per `step()`: a driver that
    interleaves the steps with generation keeps it moving while a long input is embedded. `private`: the KV
    lives in pools of the run's own (needed when other forwards run between the steps), else in the shared pools
    when their free lists hold it. `close()` releases the KV."""

    def __init__(self, runner: ModelRunner, token_lists: Sequence[Sequence[int]], token_budget: int, *,
                 private: bool = False):
        self.runner, self.token_lists, self.token_budget = runner, token_lists, token_budget
        n_blocks = sum(blocks_for(len(tokens)) for tokens in token_lists)
        n_window = sum(runner.window_blocks_for(len(tokens), token_budget) for tokens in token_lists)
        self.space = runner.scratch_space(n_blocks, n_window, private=private)
        self.sequences = [runner.new_sequence() for _ in token_lists]
        self.states = [np.empty((len(tokens), runner.hidden_size), dtype=np.float32) for tokens in token_lists]

    def step(self) -> bool:
        """Feed the next token budget; True once every list is done (then there is nothing left to feed)."""
        fed, room = [], self.token_budget
        for index, tokens in enumerate(self.token_lists):
            take = min(len(tokens) - self.sequences[index].n_past, room)
            if take > 0:
                fed.append((index, self.sequences[index].n_past, take))
                room -= take
        if not fed:
            return True
        requests = [ForwardRequest(self.sequences[i], self.token_lists[i][start: start + take], "all")
                    for i, start, take in fed]
        for (i, start, take), rows in zip(fed, self.runner.forward(requests, hidden=True, space=self.space)):
            self.states[i][start: start + take] = rows
        return all(sequence.n_past == len(tokens) for sequence, tokens in zip(self.sequences, self.token_lists))

    def close(self) -> None:
        for sequence in self.sequences:
            sequence.reset(self.space.pool, self.space.window_pool)


def hidden_states(runner: ModelRunner, token_lists: Sequence[Sequence[int]], token_budget: int) -> list[np.ndarray]:
    """The final norm's output at every position of each token list run as a fresh sequence, [n_i, hidden]
    float32; the forwards feed at most token_budget tokens each."""
    run = EmbeddingRun(runner, token_lists, token_budget)
    try:
        while not run.step():
            pass
        return run.states
    finally:
        run.close()


class EmbeddingJob:
    """The vectors of inputs that `check_inputs` accepted, [len(token_lists), hidden] float32 in `vectors`,
    computed one forward per `step()`: the inputs in the groups of `input_batches`, each an EmbeddingRun.
    `interleaved`: other forwards run between the steps, so a group that takes more than one step keeps its KV in
    pools of its own."""

    def __init__(self, runner: ModelRunner, token_lists: Sequence[Sequence[int]], token_budget: int, pooling: str,
                 *, interleaved: bool):
        self.runner, self.token_lists, self.token_budget, self.pooling = runner, token_lists, token_budget, pooling
        self.interleaved = interleaved
        self.vectors = np.empty((len(token_lists), runner.hidden_size), dtype=np.float32)
        self.batches = deque(input_batches([len(tokens) for tokens in token_lists], token_budget))
        self.run: EmbeddingRun | None = None

    def step(self) -> bool:
        """One forward; True once every vector is in `vectors`."""
        batch = self.batches[0]
        if self.run is None:
            inputs = [self.token_lists[i] for i in batch]
            self.run = EmbeddingRun(self.runner, inputs, self.token_budget,
                                    private=self.interleaved and sum(map(len, inputs)) > self.token_budget)
        if self.run.step():
            for index, state in zip(batch, self.run.states):
                self.vectors[index] = pooled(state, self.pooling)
            self.close()
            self.batches.popleft()
        return not self.batches

    def close(self) -> None:
        """Release the KV of the run in progress (the job is abandoned, or its run is done)."""
        if self.run is not None:
            self.run.close()
            self.run = None


def pooled(states: np.ndarray, pooling: str) -> np.ndarray:
    """One sequence's hidden states [n, hidden] pooled (a name of POOLINGS) and L2-normalised, float32."""
    vector = POOLINGS[pooling](states)
    norm = np.sqrt(np.dot(vector, vector))
    return (vector / norm if norm > 0 else vector).astype(np.float32)
