"""The Python API: `basert.Model(path)` to encode, prefill, decode and generate with a .base model."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from basert.chat.detokenizer import IncrementalDetokenizer
from basert.engine.runner import ForwardRequest, ModelRunner
from basert.engine.sampler import Sampler, SamplingParams
from basert.tokenizer import Tokenizer, TokenizerError

Prompt = str | Sequence[int]
TokenCallback = Callable[[int, str], bool]


@dataclass(slots=True)
class GenerationStats:
    """What one generate() call produced and how fast."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    finish_reason: str = "length"    # "stop" (end-of-sequence token), "length", or "callback"

    @property
    def generated_tokens(self) -> int:
        return len(self.tokens)

    @property
    def prefill_tokens_per_second(self) -> float:
        computed = self.prompt_tokens - self.cached_tokens
        return computed / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        # The first generated token comes from the prefill logits; the rest each cost one decode step.
        steps = max(self.generated_tokens - 1, 0)
        return steps / self.decode_seconds if self.decode_seconds > 0 else 0.0


class Model:
    """A loaded .base model with one sequence: prompts are text or token ids.

    Consecutive calls reuse the longest common prefix of tokens with the previous sequence
    (attention-only models truncate their KV; hybrids continue only an exact extension).
    """

    def __init__(self, path: str | Path, *, max_context: int = 4096, threads: int | None = None,
                 kv_bits: int = 32):
        if kv_bits not in (16, 32):
            raise ValueError("kv_bits must be 16 or 32")
        self.runner = ModelRunner(path, max_context=max_context, threads=threads,
                                  kv_dtype=np.float16 if kv_bits == 16 else np.float32)
        tokenizer_object = self.runner.base.tokenizer
        self.tokenizer = (None if tokenizer_object.get("tokenizer_type") == "none"
                          else Tokenizer.from_object(tokenizer_object))
        self.sequence = self.runner.new_sequence()
        self.path = Path(path)

    # --- metadata ---------------------------------------------------------------------------
    @property
    def config(self) -> dict:
        return self.runner.config

    @property
    def arch(self) -> str:
        return self.runner.arch

    def tensors(self) -> list[dict]:
        """Name, dtype, shape and byte size of every tensor in the file."""
        return [{"name": t.name, "dtype": t.dtype, "shape": list(t.array_shape), "bytes": t.length}
                for t in self.runner.base.tensors.values()]

    # --- text <-> tokens --------------------------------------------------------------------
    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise TokenizerError(f"{self.path} has no tokenizer: pass prompts as token ids")
        return self.tokenizer

    def encode(self, text: str) -> list[int]:
        """Token ids for text, exactly as the model's reference tokenizer (no BOS added)."""
        return self._require_tokenizer().encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._require_tokenizer().decode(list(ids))

    def decode_token(self, token_id: int) -> str:
        """The text of one token (a partial UTF-8 character decodes with replacement)."""
        return self._require_tokenizer().token_bytes(token_id).decode("utf-8", errors="replace")

    def _tokens(self, prompt: Prompt) -> list[int]:
        tokens = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not tokens:
            raise ValueError("the prompt is empty")
        return tokens

    # --- low-level stepping -----------------------------------------------------------------
    def reset(self) -> None:
        """Forget the current sequence."""
        self.runner.release(self.sequence)

    def prefill(self, prompt: Prompt) -> np.ndarray:
        """Start a sequence from a prompt (reusing a common prefix); the last position's logits."""
        logits, _ = self._prefill(self._tokens(prompt))
        return logits

    def decode_step(self, token_id: int) -> np.ndarray:
        """Append one token to the sequence; the logits for the next position (a copy you may keep)."""
        return self._decode(token_id).copy()

    def _decode(self, token_id: int) -> np.ndarray:
        """decode_step's logits as a scratch view, valid until the next forward (no allocation)."""
        return self.runner.forward([ForwardRequest(self.sequence, [int(token_id)])])[0][0]

    def _prefill(self, tokens: list[int]) -> tuple[np.ndarray, int]:
        reused = self._reuse_prefix(tokens)
        try:
            logits = self.runner.forward([ForwardRequest(self.sequence, tokens[reused:])])[0][0].copy()
        except Exception:
            self.reset()
            raise
        return logits, reused

    def _reuse_prefix(self, tokens: list[int]) -> int:
        """Keep the longest usable common prefix with the current sequence; returns its length."""
        history = self.sequence.tokens
        common = 0
        limit = min(len(history), len(tokens) - 1)  # the last prompt token is always recomputed
        while common < limit and history[common] == tokens[common]:
            common += 1
        if self.sequence.recurrent is not None and common != len(history):
            common = 0
        if common == 0:
            self.reset()
        else:
            self.runner.rewind(self.sequence, common)
        return common

    # --- generation -------------------------------------------------------------------------
    def _run(self, prompt: Prompt, stats: GenerationStats, max_tokens: int, params: SamplingParams,
             stop_at_eos: bool) -> Iterator[tuple[int | None, str]]:
        tokens = self._tokens(prompt)
        params.validate(self.runner.vocab_size)
        sampler = Sampler(params, self.runner.vocab_size)
        detokenizer = IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None
        eos = self.tokenizer.eos_ids if (self.tokenizer is not None and stop_at_eos) else frozenset()
        history = list(tokens)
        started = time.perf_counter()
        logits, stats.cached_tokens = self._prefill(tokens)
        stats.prompt_tokens = len(tokens)
        stats.prefill_seconds = time.perf_counter() - started
        decode_started = time.perf_counter()
        for index in range(max_tokens):
            token, _ = sampler.sample(logits, history)
            if token in eos:
                stats.finish_reason = "stop"
                break
            history.append(token)
            stats.tokens.append(token)
            piece = detokenizer.push(token) if detokenizer is not None else ""
            stats.text += piece
            yield token, piece
            if stats.finish_reason == "callback":
                break
            if index + 1 < max_tokens:
                logits = self._decode(token)
        else:
            stats.finish_reason = "length"
        stats.decode_seconds = time.perf_counter() - decode_started
        tail = detokenizer.flush() if detokenizer is not None else ""
        if tail:
            # Bytes of an unfinished character at the end come out as U+FFFD, never lost silently.
            stats.text += tail
            yield None, tail

    def generate(self, prompt: Prompt, max_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, min_p: float = 0.0, repeat_penalty: float = 1.0,
                 seed: int | None = None, callback: TokenCallback | None = None,
                 stop_at_eos: bool = True) -> GenerationStats:
        """Generate up to max_tokens; callback(token_id, text) returning False stops early."""
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                repeat_penalty=repeat_penalty, seed=seed)
        stats = GenerationStats()
        for token, piece in self._run(prompt, stats, max_tokens, params, stop_at_eos):
            if token is not None and callback is not None and callback(token, piece) is False:
                stats.finish_reason = "callback"
        return stats

    def generate_text(self, prompt: Prompt, max_tokens: int = 128, **sampling) -> str:
        """The generated text only."""
        return self.generate(prompt, max_tokens, **sampling).text

    def stream(self, prompt: Prompt, max_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, min_p: float = 0.0, repeat_penalty: float = 1.0,
               seed: int | None = None, stop_at_eos: bool = True) -> Iterator[str]:
        """Yield text pieces as they are generated (whole UTF-8 characters only)."""
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                repeat_penalty=repeat_penalty, seed=seed)
        stats = GenerationStats()
        for _, piece in self._run(prompt, stats, max_tokens, params, stop_at_eos):
            if piece:
                yield piece

    # --- lifecycle --------------------------------------------------------------------------
    def close(self) -> None:
        self.runner.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
