"""Chooses each next token from one float32 row of logits, with OpenAI and llama.cpp sampling parameters.

Order of operations for a row (the caller's array is never modified):

1. logit_bias: `logit += bias`.
2. repeat_penalty (llama.cpp): each distinct token among the last `repeat_last_n` tokens of the
   history (-1: the whole history, 0: off) has a positive logit divided by the penalty and a
   negative one multiplied by it.
3. presence/frequency penalties (OpenAI arithmetic): `logit -= presence * (count > 0) + frequency * count`,
   with `count` taken over the whole history, prompt tokens included.
4. Logprobs, when asked for: the float64 log-softmax of this row, i.e. the model's distribution after
   bias and penalties but before temperature and truncation, as OpenAI reports it.
5. temperature 0: argmax, lowest id on ties. Otherwise: divide by the temperature, then top_k (ties at
   the k-th value go to the lower ids), top_p (the smallest best-first prefix whose probability reaches
   top_p, never empty), min_p (drop tokens whose probability is below min_p times the best one's),
   renormalise, and draw with the sampler's own generator seeded from `seed`. Temperature comes before
   truncation as in vLLM and HF transformers; llama.cpp's default chain applies it last.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from basert.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20
# top_p sorts only the best NUCLEUS_PROBE tokens, then NUCLEUS_PROBE_GROWTH times more while they
# hold less than top_p of the mass: a stable argsort of a whole 150k-token row costs ~25 ms.
NUCLEUS_PROBE = 1024
NUCLEUS_PROBE_GROWTH = 8


class SamplingError(InvalidRequestError, ValueError):
    """A sampling parameter is out of range; the message names the field."""


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _require(ok: bool, name: str, requirement: str, value: object) -> None:
    if not ok:
        raise SamplingError(f"{name} must be {requirement}, got {value!r}")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to choose each next token; the defaults sample the model's distribution unchanged."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Given as {token id: bias} (or pairs); stored as (id, bias) pairs sorted by id so params stay hashable.
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        try:
            pairs = tuple(sorted((operator.index(k), float(v)) for k, v in dict(self.logit_bias).items()))
        except (TypeError, ValueError) as exc:
            raise SamplingError(f"logit_bias must map integer token ids to numbers ({exc})") from None
        object.__setattr__(self, "logit_bias", pairs)

    @property
    def greedy(self) -> bool:
        """True when temperature is 0: always the most likely token."""
        return self.temperature == 0

    def validate(self, vocab_size: int) -> None:
        """Raise SamplingError naming the first field that is invalid for a vocabulary of vocab_size tokens."""
        _require(
            math.isfinite(self.temperature) and self.temperature >= 0,
            "temperature",
            "a finite number >= 0",
            self.temperature,
        )
        _require(_is_int(self.top_k) and self.top_k >= 0, "top_k", "an integer >= 0", self.top_k)
        _require(0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _require(0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        _require(
            math.isfinite(self.repeat_penalty) and self.repeat_penalty > 0,
            "repeat_penalty",
            "a finite number > 0",
            self.repeat_penalty,
        )
        _require(
            _is_int(self.repeat_last_n) and self.repeat_last_n >= -1,
            "repeat_last_n",
            "an integer >= -1 (-1: whole history, 0: off)",
            self.repeat_last_n,
        )
        _require(math.isfinite(self.presence_penalty), "presence_penalty", "finite", self.presence_penalty)
        _require(math.isfinite(self.frequency_penalty), "frequency_penalty", "finite", self.frequency_penalty)
        for token, bias in self.logit_bias:
            _require(0 <= token < vocab_size, "logit_bias", f"keyed by token ids in [0, {vocab_size})", token)
            _require(math.isfinite(bias), "logit_bias", f"finite (token {token})", bias)
        _require(
            self.seed is None or (_is_int(self.seed) and self.seed >= 0),
            "seed",
            "None or an integer >= 0",
            self.seed,
        )
        _require(
            _is_int(self.top_logprobs) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
            "top_logprobs",
            f"an integer in [0, {MAX_TOP_LOGPROBS}]",
            self.top_logprobs,
        )
        _require(
            self.logprobs or self.top_logprobs == 0,
            "top_logprobs",
            "0 unless logprobs is true",
            self.top_logprobs,
        )


@dataclass(slots=True)
class TokenLogprob:
    """The chosen token's log-probability and the best alternatives, (token id, logprob) best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def greedy_token(logits: np.ndarray) -> int:
    """The id of the largest logit, the lowest id among ties."""
    return int(np.argmax(logits))


class Sampler:
    """Chooses the next tokens of one request; owns its random generator and reusable row buffers."""

    __slots__ = (
        "_bias_ids",
        "_bias_values",
        "_counts",
        "_mask",
        "_repeat",
        "_rng",
        "_row",
        "_scratch",
        "_weights_buffer",
        "params",
        "vocab_size",
    )

    def __init__(self, params: SamplingParams, vocab_size: int) -> None:
        params.validate(vocab_size)
        self.params = params
        self.vocab_size = vocab_size
        self._rng = np.random.default_rng(params.seed)
        self._bias_ids = np.array([token for token, _ in params.logit_bias], dtype=np.intp)
        self._bias_values = np.array([bias for _, bias in params.logit_bias], dtype=np.float32)
        self._repeat = params.repeat_penalty != 1 and params.repeat_last_n != 0
        self._counts = params.presence_penalty != 0 or params.frequency_penalty != 0
        # Buffers are allocated only for the steps these params use: a row is vocab_size wide.
        adjusts = bool(params.logit_bias) or self._repeat or self._counts
        self._row = np.empty(vocab_size, np.float32) if adjusts else None
        self._weights_buffer = None if params.greedy else np.empty(vocab_size, np.float32)
        needs_scratch = not params.greedy or params.logprobs
        self._scratch = np.empty(vocab_size, np.float64) if needs_scratch else None
        self._mask = np.empty(vocab_size, np.bool_) if needs_scratch else None

    @property
    def uses_history(self) -> bool:
        """Whether `sample` reads the history (repeat, presence or frequency penalties)."""
        return self._repeat or self._counts

    def adjust(self, logits: np.ndarray, history: Sequence[int] | np.ndarray) -> np.ndarray:
        """Return logits after logit_bias and penalties: the sampler's reused buffer, or `logits` itself if none
        apply."""
        if logits.shape != (self.vocab_size,):
            raise ValueError(f"expected a logits row of shape ({self.vocab_size},), got {logits.shape}")
        row = self._row
        if row is None:
            return logits
        params = self.params
        np.copyto(row, logits, casting="same_kind")
        row[self._bias_ids] += self._bias_values
        if self._repeat:
            window = history if params.repeat_last_n < 0 else history[-params.repeat_last_n :]
            ids = np.unique(np.asarray(window, dtype=np.intp))
            values = row[ids]
            row[ids] = np.where(values > 0, values / params.repeat_penalty, values * params.repeat_penalty)
        if self._counts:
            ids, counts = np.unique(np.asarray(history, dtype=np.intp), return_counts=True)
            row[ids] -= params.presence_penalty + params.frequency_penalty * counts
        return row

    def sample(self, logits: np.ndarray, history: Sequence[int] | np.ndarray) -> tuple[int, TokenLogprob | None]:
        """Choose the next token from one logits row; history is every token so far (prompt + generated)."""
        row = self.adjust(logits, history)
        token = greedy_token(row) if self.params.greedy else self._draw(row)
        return token, self._token_logprob(row, token) if self.params.logprobs else None

    def _token_logprob(self, row: np.ndarray, token: int) -> TokenLogprob:
        """Float64 log-softmax of row at token and at the top_logprobs best tokens."""
        top = float(row.max())
        shifted = self._scratch
        np.copyto(shifted, row)
        shifted -= top
        log_total = math.log(np.exp(shifted, out=shifted).sum())
        n_best = self.params.top_logprobs
        best = self._best(row, n_best)[:n_best] if n_best else ()
        return TokenLogprob(
            token_id=token,
            logprob=float(row[token]) - top - log_total,
            top=[(int(i), float(row[i]) - top - log_total) for i in best],
        )

    def _draw(self, row: np.ndarray) -> int:
        # Truncation works on the row itself: dividing by the temperature keeps the order, and
        # comparing unscaled float32 logits keeps top_k=1 identical to greedy_token.
        params = self.params
        top = row.max()
        ids = None  # candidates left after truncation; None means every token, in id order
        if 0 < params.top_k < self.vocab_size:
            ids = self._best(row, params.top_k)[: params.top_k]
        if params.top_p < 1:
            ids = self._nucleus(row, top, ids)
        if params.min_p > 0:
            # p >= min_p * p_max  <=>  (logit - max) / temperature >= log(min_p): no softmax needed.
            floor = float(top) + params.temperature * math.log(params.min_p)
            if ids is None:
                ids = np.flatnonzero(np.greater_equal(row, floor, out=self._mask))
            else:
                ids = ids[row[ids] >= floor]
        if ids is None:
            cumulative = np.cumsum(self._all_weights(row, top), dtype=np.float64, out=self._scratch)
        else:
            cumulative = np.cumsum(self._weights(row, top, ids), dtype=np.float64)
        chosen = int(np.searchsorted(cumulative, self._rng.random() * cumulative[-1], side="right"))
        # random() * total can round up to total itself, which searchsorted places past the end.
        chosen = min(chosen, len(cumulative) - 1)
        return chosen if ids is None else int(ids[chosen])

    def _weights(self, row: np.ndarray, top: np.floating, ids: np.ndarray) -> np.ndarray:
        """Unnormalised probabilities exp((logit - max) / temperature) of the tokens ids, in the row's dtype."""
        return np.exp((row[ids] - top) / self.params.temperature)

    def _all_weights(self, row: np.ndarray, top: np.floating) -> np.ndarray:
        """_weights of every token, in the sampler's buffer; float32 because exp is 4x faster than float64."""
        weights = np.subtract(row, top, out=self._weights_buffer)
        np.divide(weights, self.params.temperature, out=weights)
        return np.exp(weights, out=weights)

    def _nucleus(self, row: np.ndarray, top: np.floating, ids: np.ndarray | None) -> np.ndarray:
        """The shortest best-first prefix of ids (None: the whole vocabulary) holding top_p of their probability."""
        if ids is None:
            total = self._all_weights(row, top).sum(dtype=np.float64)
            # Sort only as many of the best tokens as the nucleus needs, growing the probe until
            # it holds top_p of the mass. cumsum is sequential, so a probe's sums are exactly the
            # first sums of any larger probe, and the cut does not depend on the probe size.
            probe = NUCLEUS_PROBE
            while True:
                ids = self._best(row, probe)
                cumulative = np.cumsum(self._weights(row, top, ids), dtype=np.float64) / total
                if cumulative[-1] >= self.params.top_p or probe >= self.vocab_size:
                    break
                probe *= NUCLEUS_PROBE_GROWTH
        else:
            cumulative = np.cumsum(self._weights(row, top, ids), dtype=np.float64)
            cumulative /= cumulative[-1]
        return ids[: int(np.searchsorted(cumulative, self.params.top_p, side="left")) + 1]

    def _best(self, values: np.ndarray, n: int) -> np.ndarray:
        """Ids of the n largest values plus any tied with the n-th, best first, lower id first on ties."""
        if n < self.vocab_size:
            kth = self.vocab_size - n
            np.copyto(self._scratch, values)
            self._scratch.partition(kth)
            ids = np.flatnonzero(np.greater_equal(values, self._scratch[kth], out=self._mask))
        else:
            ids = np.arange(self.vocab_size)
        return ids[np.argsort(-values[ids], kind="stable")]
