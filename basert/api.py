"""The Python API: `basert.Model(path)` to encode, prefill, decode and generate with a .base model.

A thin driver of the engine (`basert.engine`): generation runs through `Engine.generate` on one slot, so
it reuses prefixes, samples, stops and detokenizes exactly as the server does.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from basert.engine.build import EngineOptions, build_engine
from basert.engine.sampler import SamplingParams
from basert.engine.types import FailEvent, FinishEvent, GenerationRequest
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
    finish_reason: str = "length"    # "stop" (end-of-sequence token or stop string), "length", or "callback"

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
    """A loaded .base model with one slot: prompts are text or token ids.

    Consecutive calls reuse the longest usable common prefix with the slot's history (attention KV is
    truncated; a hybrid's recurrent state resumes from an exact extension or a checkpoint).
    """

    def __init__(self, path: str | Path, *, max_context: int = 4096, threads: int | None = None,
                 kv_bits: int = 32):
        self.path = Path(path)
        self.engine = build_engine(self.path, EngineOptions(max_context=max_context, threads=threads,
                                                            kv_bits=kv_bits, model_id=self.path.stem))
        self.info = self.engine.info
        self.tokenizer: Tokenizer | None = self.engine.tokenizer
        self._request_ids = itertools.count()

    # --- metadata ---------------------------------------------------------------------------
    @property
    def config(self) -> dict:
        return self.engine.runner.base.config

    @property
    def arch(self) -> str:
        return self.info.arch

    def tensors(self) -> list[dict]:
        """Name, dtype, shape and byte size of every tensor in the file."""
        return [{"name": t.name, "dtype": t.dtype, "shape": list(t.array_shape), "bytes": t.length}
                for t in self.engine.runner.base.tensors.values()]

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
        self.engine.erase(0)

    def prefill(self, prompt: Prompt) -> np.ndarray:
        """Start a sequence from a prompt (reusing a common prefix); the last position's logits."""
        logits, _ = self.engine.prefill(self._tokens(prompt))
        return logits

    def decode_step(self, token_id: int) -> np.ndarray:
        """Append one token to the sequence; the logits for the next position (a copy you may keep)."""
        return self.engine.decode(token_id).copy()

    # --- generation -------------------------------------------------------------------------
    def _events(self, prompt: Prompt, stats: GenerationStats, max_tokens: int, sampling: SamplingParams,
                stop: Sequence[str], stop_at_eos: bool, callback: TokenCallback | None) -> Iterator[str]:
        """Run one request on the engine, filling `stats`; yields text as it becomes final."""
        request = GenerationRequest(f"api-{next(self._request_ids)}", self._tokens(prompt), max_tokens, sampling,
                                    stop=tuple(stop), ignore_eos=not stop_at_eos)
        stats.prompt_tokens = len(request.prompt)
        finish: FinishEvent | None = None
        events = self.engine.generate(request)
        try:
            for event in events:
                if isinstance(event, FailEvent):
                    raise event.error
                if isinstance(event, FinishEvent):
                    finish = event
                    break
                stats.tokens.append(event.token_id)
                if event.text:
                    stats.text += event.text
                    yield event.text
                if callback is not None and callback(event.token_id, event.text) is False:
                    finish = self.engine.cancel(request.request_id, "callback")
                    break
        finally:
            events.close()
        if finish.text:
            # Bytes of an unfinished character at the end come out as U+FFFD, never lost silently.
            stats.text += finish.text
            yield finish.text
        stats.finish_reason = finish.finish_reason
        stats.cached_tokens = finish.usage.cached_tokens
        stats.prefill_seconds = finish.timings.prompt_ms / 1000
        stats.decode_seconds = finish.timings.predicted_ms / 1000

    def generate(self, prompt: Prompt, max_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, min_p: float = 0.0, repeat_penalty: float = 1.0,
                 seed: int | None = None, callback: TokenCallback | None = None,
                 stop_at_eos: bool = True, stop: Sequence[str] = ()) -> GenerationStats:
        """Generate up to max_tokens; callback(token_id, text) returning False stops early; generation also
        stops before any of the `stop` strings (which are not part of the text).

        The callback's text is what became final with that token; text still held back at the end (a possible
        stop string, an unfinished character) is only in the returned `text`."""
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                  repeat_penalty=repeat_penalty, seed=seed)
        stats = GenerationStats()
        for _ in self._events(prompt, stats, max_tokens, sampling, stop, stop_at_eos, callback):
            pass
        return stats

    def generate_text(self, prompt: Prompt, max_tokens: int = 128, **sampling) -> str:
        """The generated text only."""
        return self.generate(prompt, max_tokens, **sampling).text

    def stream(self, prompt: Prompt, max_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, min_p: float = 0.0, repeat_penalty: float = 1.0,
               seed: int | None = None, stop_at_eos: bool = True, stop: Sequence[str] = ()) -> Iterator[str]:
        """Yield text pieces as they are generated (whole UTF-8 characters only)."""
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                  repeat_penalty=repeat_penalty, seed=seed)
        yield from self._events(prompt, GenerationStats(), max_tokens, sampling, stop, stop_at_eos, None)

    # --- embeddings -------------------------------------------------------------------------
    def embed(self, prompts: Sequence[Prompt], pooling: str = "mean") -> np.ndarray:
        """L2-normalised embeddings [len(prompts), hidden] float32 of texts or token-id lists: the last hidden
        states pooled by "mean", "last" or "cls" (the first token). The slot's history is left as it was."""
        token_lists = [self.encode(p) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
        return self.engine.embed(token_lists, pooling)

    # --- lifecycle --------------------------------------------------------------------------
    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
