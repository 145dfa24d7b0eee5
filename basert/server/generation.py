"""From a validated request to engine requests and back: prompt rendering, choices, responses, SSE chunks."""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import trio

from basert.actor.messages import Cancel, Generate
from basert.engine.runner import ContextOverflowError
from basert.engine.sampler import SamplingParams, TokenLogprob
from basert.engine.types import FailEvent, FinishEvent, GenerationRequest, OutputStop, TokenEvent
from basert.server.catalog import ServedModel
from basert.server.errors import ApiError, invalid
from basert.server.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields


@dataclass(slots=True)
class ServerLimits:
    default_max_tokens: int = 2048
    request_timeout_ms: int = 0


def sampling_params(body: SamplingFields, choice: int, logprobs: bool, top_logprobs: int) -> SamplingParams:
    seed = body.seed + choice if body.seed is not None and body.seed >= 0 else None
    bias = {int(k): float(v) for k, v in (body.logit_bias or {}).items()}
    return SamplingParams(
        temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, min_p=body.min_p,
        repeat_penalty=body.repeat_penalty, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, logit_bias=bias, seed=seed,
        logprobs=logprobs, top_logprobs=top_logprobs,
    )


def engine_requests(model: ServedModel, body: SamplingFields, prompt: list[int], max_tokens: int | None,
                    limits: ServerLimits, *, logprobs: bool, top_logprobs: int, constraint_factory=None,
                    id_prefix: str, segment_ends: tuple[int, ...] = (),
                    stop_after: Callable[[], OutputStop] | None = None) -> list[GenerationRequest]:
    """One GenerationRequest per choice (each with its own sampler seed, grammar matcher and `stop_after()`)."""
    if len(prompt) + 1 > model.info.n_ctx and not model.info.has("context_shift"):
        raise ContextOverflowError(len(prompt), model.info.n_ctx)
    if not prompt:
        raise invalid("the prompt is empty", "prompt")
    budget = max_tokens or limits.default_max_tokens
    deadline = time.monotonic() + limits.request_timeout_ms / 1000 if limits.request_timeout_ms > 0 else None
    requests = []
    for choice in range(body.n):
        params = sampling_params(body, choice, logprobs, top_logprobs)
        params.validate(model.info.vocab_size)
        requests.append(GenerationRequest(
            request_id=f"{id_prefix}-{choice}",
            prompt=prompt,
            max_tokens=budget,
            sampling=params,
            stop=tuple(body.stop or ()),
            constraint=constraint_factory() if constraint_factory else None,
            ignore_eos=body.ignore_eos,
            deadline=deadline,
            segment_ends=segment_ends,
            stop_after=stop_after() if stop_after else None,
            speculative=body.speculative,
            draft_max=body.speculative_n_max,
            n_keep=body.n_keep,
        ))
    return requests


class ChoiceSet:
    """The engine requests of one HTTP request (one per choice), their reply channels, and cleanup.

    `close()` cancels every request that has not finished: handlers call it in a `finally`, so a
    client that disconnects frees its slots at once.
    """

    def __init__(self, model: ServedModel, requests: list[GenerationRequest]):
        self.model = model
        self.requests = requests
        self.channels: list[trio.MemoryReceiveChannel] = []
        self.finished = [False] * len(requests)
        self._first: TokenEvent | FinishEvent | None = None   # the first choice's first reply, once `started` saw it

    async def submit(self, slot_hint: int | None) -> None:
        """Send every choice to the model; the first goes to slot `slot_hint` (None or -1: any slot)."""
        slot_hint = None if slot_hint == -1 else slot_hint
        for index, request in enumerate(self.requests):
            send, receive = trio.open_memory_channel(math.inf)
            self.channels.append(receive)
            await self.model.actor.mailbox.send(Generate(request, send, slot_hint if index == 0 else None))

    async def started(self) -> None:
        """Wait for the first choice's first reply, so that a refusal (busy, queue timeout, bad slot) is
        raised before a stream sends its first byte and becomes the response's HTTP status."""
        try:
            try:
                reply = await self.channels[0].receive()
            except trio.EndOfChannel:
                reply = None
            self._first = self._checked(0, reply)
        except BaseException:
            self.close()
            raise

    async def replies(self, index: int) -> AsyncIterator[TokenEvent | FinishEvent]:
        """Replies of one choice until it is done; a failure is raised."""
        if index == 0 and self._first is not None:
            reply, self._first = self._first, None
            yield reply
            if self.finished[index]:
                return
        async for reply in self.channels[index]:
            yield self._checked(index, reply)
            if self.finished[index]:
                return
        self._checked(index, None)

    def _checked(self, index: int, reply: TokenEvent | FinishEvent | FailEvent | None) -> TokenEvent | FinishEvent:
        if reply is None and not self.finished[index]:
            self.finished[index] = True
            raise RuntimeError("the model stopped before the request finished")
        if isinstance(reply, FailEvent):
            self.finished[index] = True
            raise reply.error
        if isinstance(reply, FinishEvent):
            self.finished[index] = True
        return reply

    def close(self) -> None:
        for index, request in enumerate(self.requests):
            if not self.finished[index]:
                self.finished[index] = True
                try:
                    self.model.actor.mailbox.send_nowait(Cancel(request.request_id))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
        for channel in self.channels:
            channel.close()


def output_grammar(model: ServedModel, body: SamplingFields):
    """The grammar a request's `grammar` (GBNF), `json_schema` or `response_format` asks for, or None; an invalid one
    is a 400."""
    constraint = body.output_constraint()
    if constraint is None:
        return None
    kind, value = constraint
    factory = model.grammar_factory()
    if kind == "gbnf":
        return factory.gbnf(value)
    if kind == "json_schema":
        return factory.json_schema(value)
    return factory.json_object()


def usage_body(prompt_tokens: int, done_list: list[FinishEvent]) -> dict:
    completion = sum(d.usage.completion_tokens for d in done_list)
    cached = done_list[0].usage.cached_tokens if done_list else 0
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def timings_body(done_list: list[FinishEvent]) -> dict:
    if not done_list:
        return {}
    first = done_list[0]
    return first.timings.as_dict(first.usage.cached_tokens)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def token_piece(model: ServedModel, token_id: int) -> tuple[str, list[int]]:
    raw = model.tokenizer.token_bytes(token_id) if model.tokenizer is not None else b""
    return raw.decode("utf-8", errors="replace"), list(raw)


# What a log probability of minus infinity (a token a grammar or logit_bias ruled out) is reported as:
# JSON has no infinity, and OpenAI reports such tokens with this value.
LOGPROB_FLOOR = -9999.0


def finite_logprob(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


def chat_logprobs(model: ServedModel, ids: list[int], logprobs: list[TokenLogprob | None]) -> dict:
    content = []
    for token_id, lp in zip(ids, logprobs):
        if lp is None:
            continue
        text, raw = token_piece(model, token_id)
        top = []
        for alt_id, alt_lp in lp.top:
            alt_text, alt_raw = token_piece(model, alt_id)
            top.append({"token": alt_text, "logprob": finite_logprob(alt_lp), "bytes": alt_raw})
        content.append({"token": text, "logprob": finite_logprob(lp.logprob), "bytes": raw, "top_logprobs": top})
    return {"content": content}


def completion_logprobs(model: ServedModel, ids: list[int], logprobs: list[TokenLogprob | None],
                        offset: int) -> dict:
    tokens, token_logprobs, tops, offsets = [], [], [], []
    position = offset
    for token_id, lp in zip(ids, logprobs):
        text, _ = token_piece(model, token_id)
        tokens.append(text)
        token_logprobs.append(finite_logprob(lp.logprob) if lp else None)
        tops.append({token_piece(model, i)[0]: finite_logprob(v) for i, v in lp.top} if lp else None)
        offsets.append(position)
        position += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def sse(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()


def completion_prompts(model: ServedModel, body: CompletionRequest) -> list[list[int]]:
    """The prompt(s) of a /v1/completions request as token lists: text starts with the model's BOS token where its
    tokenizer adds one (as llama.cpp's server and transformers do), token ids are taken as they are."""
    prompt = body.prompt
    if isinstance(prompt, str):
        return [model.require_tokenizer().encode(prompt, add_special=True)]
    if not prompt:
        raise invalid("prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return [model.require_tokenizer().encode(p, add_special=True) for p in prompt]
    return [list(p) for p in prompt]


def max_tokens_of(body: SamplingFields) -> int | None:
    """The request's token budget, or None for the server's default."""
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        return body.max_completion_tokens
    return body.token_budget()


def check_prompt_ids(model: ServedModel, prompt: list[int]) -> None:
    vocab = model.info.vocab_size
    if any(not 0 <= t < vocab for t in prompt):
        raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt", code="invalid_value")
