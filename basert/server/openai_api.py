"""OpenAI chat completions and text completions: the chat driver's events (or the engine's, for text) in OpenAI's
`chat.completion` / `text_completion` objects and their streamed chunks."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from basert import __version__
from basert.engine.types import FinishEvent, TokenEvent
from basert.server.access_log import RequestRecord
from basert.server.catalog import ServedModel
from basert.server.chat_api import ChatRun, ChoiceDelta, ChoiceEnd, start_chat
from basert.server.errors import invalid, to_api_error
from basert.server.generation import (
    ChoiceSet,
    ServerLimits,
    chat_logprobs,
    check_prompt_ids,
    completion_logprobs,
    completion_prompts,
    engine_requests,
    max_tokens_of,
    new_id,
    output_grammar,
    sse,
    timings_body,
    usage_body,
)
from basert.server.schemas import ChatCompletionRequest, CompletionRequest


def system_fingerprint(model: ServedModel) -> str:
    """`system_fingerprint` in llama.cpp's build-tag form ("b" first, as its clients check): BaseRT's version and
    the model file's fingerprint, so it changes when either does."""
    return f"b{__version__}-{model.info.fingerprint}"

# --- chat ---------------------------------------------------------------------------------------


async def chat_completion(model: ServedModel, body: ChatCompletionRequest, limits: ServerLimits,
                          record: RequestRecord):
    """A chat.completion object, or an async iterator of SSE chunks when streaming."""
    run = await start_chat(model, body, limits, record)
    if body.stream:
        return stream_chat(run)
    return chat_object(run, await run.results())


def chat_object(run: ChatRun, ends: list[ChoiceEnd]) -> dict:
    choices = []
    for end in ends:
        logprobs = chat_logprobs(run.model, end.state.ids, end.state.logprobs) if run.want_logprobs else None
        choices.append({"index": end.index, "message": end.state.message(), "finish_reason": end.finish_reason,
                        "logprobs": logprobs})
    return {
        "id": run.response_id, "object": "chat.completion", "created": run.created, "model": run.model.info.id,
        "choices": choices, "usage": run.usage(), "timings": run.timings(),
        "system_fingerprint": system_fingerprint(run.model),
    }


def delta_parts(delta: ChoiceDelta) -> list[dict]:
    """The OpenAI `delta` objects for one chat delta: reasoning, content, tool calls (no empty strings)."""
    parts = []
    if delta.reasoning:
        parts.append({"reasoning_content": delta.reasoning})
    if delta.content:
        parts.append({"content": delta.content})
    if delta.tool_calls:
        parts.append({"tool_calls": [d.to_openai() for d in delta.tool_calls]})
    return parts


async def stream_chat(run: ChatRun) -> AsyncIterator[bytes]:
    """chat.completion.chunk events: per choice a role chunk (`content: null`), its deltas, a finish chunk; then the
    usage chunk when asked for, and [DONE]. A failure after the first byte is an error event, then [DONE]."""
    base = {"id": run.response_id, "object": "chat.completion.chunk", "created": run.created,
            "model": run.model.info.id, "system_fingerprint": system_fingerprint(run.model)}

    def chunk(index: int, delta: dict, finish: str | None = None, logprobs: dict | None = None) -> bytes:
        return sse({**base, "choices": [{"index": index, "delta": delta, "finish_reason": finish,
                                         "logprobs": logprobs}]})

    started: set[int] = set()
    try:
        async with aclosing(run.events()) as events:
            async for event in events:
                if event.index not in started:
                    started.add(event.index)
                    yield chunk(event.index, {"role": "assistant", "content": None})
                if isinstance(event, ChoiceEnd):
                    yield chunk(event.index, {}, event.finish_reason)
                    continue
                logprobs = event.logprobs
                for part in delta_parts(event):
                    yield chunk(event.index, part, logprobs=logprobs)
                    logprobs = None
                if logprobs is not None:
                    yield chunk(event.index, {}, logprobs=logprobs)
        if run.body.stream_options is not None and run.body.stream_options.include_usage:
            yield sse({**base, "choices": [], "usage": run.usage(), "timings": run.timings()})
        yield sse("[DONE]")
    except Exception as exc:  # after the first byte: an error event, then [DONE]
        yield sse(to_api_error(exc).body())
        yield sse("[DONE]")

# --- completions --------------------------------------------------------------------------------


async def completion(model: ServedModel, body: CompletionRequest, limits: ServerLimits, record: RequestRecord):
    """A text_completion object, or an async iterator of SSE chunks when streaming."""
    prompts = completion_prompts(model, body)
    for prompt in prompts:
        check_prompt_ids(model, prompt)
    want_logprobs = body.logprobs is not None
    response_id = new_id("cmpl")
    grammar = output_grammar(model, body)
    constraint_factory = (lambda: model.grammar_factory().matcher(grammar)) if grammar is not None else None
    requests = []
    for p_index, prompt in enumerate(prompts):
        requests += engine_requests(model, body, prompt, max_tokens_of(body), limits, logprobs=want_logprobs,
                                    top_logprobs=body.logprobs or 0, id_prefix=f"{response_id}-{p_index}",
                                    constraint_factory=constraint_factory)
    if body.stream and len(prompts) > 1:
        raise invalid("streaming supports one prompt per request", "prompt")
    record.prompt_tokens = sum(len(p) for p in prompts)
    choices = ChoiceSet(model, requests)
    created = int(time.time())
    prompt_of = [prompts[i // body.n] for i in range(len(requests))]
    echo_text = [model.tokenizer.decode(p) if (body.echo and model.tokenizer) else "" for p in prompt_of]
    await choices.submit(body.id_slot)
    if body.stream:
        await choices.started()
        return stream_completion(model, body, choices, response_id, created, echo_text, record)
    try:
        texts, done_list, ids, lps = [], [], [], []
        for index in range(len(requests)):
            text, choice_ids, choice_lps = echo_text[index], [], []
            async for reply in choices.replies(index):
                text += reply.text
                if isinstance(reply, TokenEvent):
                    choice_ids.append(reply.token_id)
                    choice_lps.append(reply.logprob)
                else:
                    done_list.append(reply)
            texts.append(text)
            ids.append(choice_ids)
            lps.append(choice_lps)
    finally:
        choices.close()
    record.absorb(done_list)
    out = []
    for index, (text, done) in enumerate(zip(texts, done_list)):
        out.append({"index": index, "text": text, "finish_reason": done.finish_reason,
                    "logprobs": completion_logprobs(model, ids[index], lps[index], len(echo_text[index]))
                    if want_logprobs else None})
    return {"id": response_id, "object": "text_completion", "created": created, "model": model.info.id,
            "choices": out, "usage": usage_body(record.prompt_tokens, done_list),
            "timings": timings_body(done_list), "system_fingerprint": system_fingerprint(model)}


async def stream_completion(model: ServedModel, body: CompletionRequest, choices: ChoiceSet, response_id: str,
                            created: int, echo_text: list[str], record: RequestRecord) -> AsyncIterator[bytes]:
    base = {"id": response_id, "object": "text_completion", "created": created, "model": model.info.id}
    done_list: list[FinishEvent] = []
    try:
        for index in range(len(choices.requests)):
            if echo_text[index]:
                yield sse({**base, "choices": [{"index": index, "text": echo_text[index], "finish_reason": None,
                                                "logprobs": None}]})
            # Tokens whose text is held back (for a possible stop string, or an unfinished character) wait, and
            # go out with the chunk that releases their text.
            ids, lps = [], []
            async for reply in choices.replies(index):
                finish = reply.finish_reason if isinstance(reply, FinishEvent) else None
                if isinstance(reply, TokenEvent):
                    ids.append(reply.token_id)
                    lps.append(reply.logprob)
                if reply.text or finish:
                    logprobs = completion_logprobs(model, ids, lps, 0) if body.logprobs is not None else None
                    yield sse({**base, "choices": [{"index": index, "text": reply.text, "finish_reason": finish,
                                                    "logprobs": logprobs}]})
                    ids, lps = [], []
                if isinstance(reply, FinishEvent):
                    done_list.append(reply)
        if body.stream_options is not None and body.stream_options.include_usage:
            yield sse({**base, "choices": [], "usage": usage_body(record.prompt_tokens, done_list),
                       "timings": timings_body(done_list)})
        yield sse("[DONE]")
    except Exception as exc:
        yield sse(to_api_error(exc).body())
        yield sse("[DONE]")
    finally:
        choices.close()
        record.absorb(done_list)

