"""/v1/chat/completions and /v1/completions: render, submit one engine request per choice, assemble."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from basert.chat.encoder import ChatEncoder
from basert.chat.reasoning import ReasoningParser, opens_in_prompt
from basert.chat.tool_calls import ToolCallParser, inject_tool_prompt, make_tool_parser
from basert.engine.sampler import TokenLogprob
from basert.engine.slots import common_prefix
from basert.engine.types import FinishEvent, TokenEvent
from basert.server.catalog import ServedModel
from basert.server.errors import invalid
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
    sse,
    timings_body,
    usage_body,
)
from basert.server.schemas import ChatCompletionRequest, CompletionRequest


@dataclass(slots=True)
class RequestRecord:
    """What the access log and metrics need about one finished request."""

    model: str = ""
    slot: int | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    prompt_per_second: float = 0.0
    predicted_per_second: float = 0.0
    ttft_ms: float = 0.0
    finish_reason: str = ""
    timed_out: bool = False

    def absorb(self, done_list: list[FinishEvent]) -> None:
        if not done_list:
            return
        first = done_list[0]
        timings = first.timings.as_dict(first.usage.cached_tokens)
        self.slot = first.slot
        self.cached_tokens = first.usage.cached_tokens
        self.completion_tokens = sum(d.usage.completion_tokens for d in done_list)
        self.prompt_per_second = timings["prompt_per_second"]
        self.predicted_per_second = timings["predicted_per_second"]
        self.ttft_ms = first.timings.ttft_ms
        self.finish_reason = ",".join(sorted({d.finish_reason for d in done_list}))
        self.timed_out = any(d.timed_out for d in done_list)


# --- chat ---------------------------------------------------------------------------------------

@dataclass(slots=True)
class ChatPlan:
    prompt: list[int]
    tools: list[dict] | None
    starts_in_reasoning: bool
    has_reasoning: bool
    segment_ends: tuple[int, ...] = ()


def plan_chat(model: ServedModel, body: ChatCompletionRequest) -> ChatPlan:
    """Render the conversation (with tools) through the model's template and tokenize it.

    Special-token text inside messages and tools stays plain text: only the template's markup becomes control tokens.
    """
    template = model.require_template()
    tokenizer = model.require_tokenizer()
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    use_tools = tools if (tools and body.tool_choice != "none") else None
    kwargs = dict(body.chat_template_kwargs or {})
    if is_constrained(body, use_tools):
        # A grammar forces the answer to start at once: a reasoning block opened by the prompt would
        # swallow it, so thinking is off unless the request asks otherwise.
        kwargs.setdefault("enable_thinking", False)
    template_tools = use_tools
    if use_tools and not template.supports_tools:
        messages = inject_tool_prompt(messages, use_tools)
        template_tools = None
    encoder = ChatEncoder(tokenizer)
    messages = encoder.hide(messages)
    rendered = template.render(messages, tools=encoder.hide(template_tools), add_generation_prompt=True, **kwargs)
    prompt = encoder.encode(rendered)
    has_reasoning = "<think>" in (tokenizer.chat_template or "") or "<think>" in rendered
    segment_ends = ()
    if model.wants_segment_ends:
        segment_ends = message_boundaries(encoder, messages, rendered, prompt)
    return ChatPlan(prompt, use_tools, opens_in_prompt(rendered), has_reasoning, segment_ends)


def message_boundaries(encoder: ChatEncoder, messages: list[dict], rendered: str, prompt: list[int]) -> tuple[int, ...]:
    """Token positions where the first message (the system prompt) and the previous turn end.

    A hybrid model keeps its recurrent state there, so the next request that shares the system prompt or
    the conversation so far resumes from it. Found by locating each message's text in the rendered prompt
    (rendering a partial conversation is not possible with every template). `messages` and `rendered` are
    what the template saw, markers included.
    """
    ends = set()
    cursor = 0
    wanted = {0, len(messages) - 2}
    for index, message in enumerate(messages[:-1]):
        content = message.get("content")
        if not isinstance(content, str) or not content:
            continue
        at = rendered.find(content, cursor)
        if at < 0:
            break
        cursor = at + len(content)
        if index in wanted:
            ends.add(common_prefix(encoder.encode(rendered[:cursor]), prompt))
    return tuple(sorted(end for end in ends if end > 0))


def is_constrained(body: ChatCompletionRequest, tools: list[dict] | None) -> bool:
    """True when a grammar will shape the output (forced tool call or a JSON response format)."""
    forced = body.tool_choice == "required" or hasattr(body.tool_choice, "function")
    json_format = body.response_format is not None and body.response_format.type != "text"
    return (forced and bool(tools)) or json_format


def constraint_factory_for(model: ServedModel, body: ChatCompletionRequest, tools: list[dict] | None):
    """A per-choice grammar matcher factory for forced tool calls and JSON response formats, or None."""
    choice = body.tool_choice
    forced_name = choice.function.name if hasattr(choice, "function") else None
    if tools and (choice == "required" or forced_name):
        if forced_name and forced_name not in {t["function"]["name"] for t in tools}:
            raise invalid(f"tool_choice names {forced_name!r}, which is not in tools", "tool_choice")
        factory = model.grammar_factory()
        # Exactly one call: with "more calls allowed" a weak model keeps opening new ones until
        # max_tokens, and the cut-off call would turn the whole answer into a "length" finish.
        grammar = factory.tool_call(tools, model.dialect, name=forced_name, parallel=False)
        return lambda: factory.matcher(grammar)
    if (choice == "required" or forced_name) and not tools:
        raise invalid("tool_choice requires tools", "tool_choice")
    fmt = body.response_format
    if fmt is not None and fmt.type != "text":
        factory = model.grammar_factory()
        grammar = factory.json_object() if fmt.type == "json_object" else factory.json_schema(fmt.json_schema.schema_)
        return lambda: factory.matcher(grammar)
    return None


@dataclass(slots=True)
class ChatChoiceState:
    """Per-choice parsers (one instance per request and choice) and what they produced."""

    reasoning: ReasoningParser | None
    tools: ToolCallParser | None
    content: str = ""
    reasoning_text: str = ""
    ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, str, list]:
        """Split new text into (reasoning delta, content delta, tool-call deltas)."""
        reasoning_delta, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        deltas = []
        if self.tools is not None and content:
            events = self.tools.feed(content)
            content, deltas = events.content, events.tool_deltas
        self.reasoning_text += reasoning_delta
        self.content += content
        return reasoning_delta, content, deltas

    def finish(self, truncated: bool) -> tuple[str, str, list]:
        reasoning_delta, content = self.reasoning.finish() if self.reasoning else ("", "")
        deltas = []
        if self.tools is not None:
            if content:
                events = self.tools.feed(content)
                content, deltas = events.content, list(events.tool_deltas)
            events = self.tools.finish(truncated)
            content += events.content
            deltas += events.tool_deltas
        self.reasoning_text += reasoning_delta
        self.content += content
        return reasoning_delta, content, deltas

    @property
    def tool_calls(self) -> list:
        return self.tools.tool_calls if self.tools is not None else []


def chat_states(model: ServedModel, plan: ChatPlan, n: int) -> list[ChatChoiceState]:
    return [
        ChatChoiceState(
            ReasoningParser(starts_in_reasoning=plan.starts_in_reasoning) if plan.has_reasoning else None,
            make_tool_parser(model.dialect, plan.tools) if plan.tools else None,
        )
        for _ in range(n)
    ]


def finish_reason_of(done: FinishEvent, state: ChatChoiceState) -> str:
    if state.tool_calls and done.finish_reason == "stop":
        return "tool_calls"
    return done.finish_reason


async def chat_completion(model: ServedModel, body: ChatCompletionRequest, limits: ServerLimits,
                          record: RequestRecord):
    """A chat.completion object, or an async iterator of SSE chunks when streaming."""
    plan = plan_chat(model, body)
    want_logprobs = body.logprobs or body.top_logprobs > 0
    requests = engine_requests(model, body, plan.prompt, max_tokens_of(body), limits,
                               logprobs=want_logprobs, top_logprobs=body.top_logprobs,
                               constraint_factory=constraint_factory_for(model, body, plan.tools),
                               id_prefix=new_id("chatcmpl"), segment_ends=plan.segment_ends)
    record.prompt_tokens = len(plan.prompt)
    choices = ChoiceSet(model, requests)
    states = chat_states(model, plan, len(requests))
    response_id = requests[0].request_id.rsplit("-", 1)[0]
    created = int(time.time())
    await choices.submit(body.id_slot)
    if body.stream:
        await choices.started()
        return stream_chat(model, body, choices, states, response_id, created, record)
    try:
        done_list = []
        for index in range(len(requests)):
            state = states[index]
            async for reply in choices.replies(index):
                if isinstance(reply, TokenEvent):
                    state.ids.append(reply.token_id)
                    state.logprobs.append(reply.logprob)
                    state.feed(reply.text)
                else:
                    state.feed(reply.text)
                    state.finish(truncated=reply.finish_reason == "length")
                    done_list.append(reply)
    finally:
        choices.close()
    record.absorb(done_list)
    out_choices = []
    for index, (state, done) in enumerate(zip(states, done_list)):
        content = state.content if (state.content or not state.tool_calls) else None
        message: dict = {"role": "assistant", "content": content}
        if state.reasoning_text:
            message["reasoning_content"] = state.reasoning_text
        if state.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in state.tool_calls]
        choice = {"index": index, "message": message, "finish_reason": finish_reason_of(done, state),
                  "logprobs": chat_logprobs(model, state.ids, state.logprobs) if want_logprobs else None}
        out_choices.append(choice)
    return {
        "id": response_id, "object": "chat.completion", "created": created, "model": model.info.id,
        "choices": out_choices, "usage": usage_body(len(plan.prompt), done_list),
        "timings": timings_body(done_list), "system_fingerprint": model.info.fingerprint,
    }


async def stream_chat(model: ServedModel, body: ChatCompletionRequest, choices: ChoiceSet,
                      states: list[ChatChoiceState], response_id: str, created: int,
                      record: RequestRecord) -> AsyncIterator[bytes]:
    want_logprobs = body.logprobs or body.top_logprobs > 0
    base = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model.info.id,
            "system_fingerprint": model.info.fingerprint}

    def chunk(index: int, delta: dict, finish: str | None = None, logprobs: dict | None = None) -> bytes:
        return sse({**base, "choices": [{"index": index, "delta": delta, "finish_reason": finish,
                                         "logprobs": logprobs}]})

    def deltas_of(reasoning: str, content: str, tool_deltas: list) -> list[dict]:
        out = []
        if reasoning:
            out.append({"reasoning_content": reasoning})
        if content:
            out.append({"content": content})
        if tool_deltas:
            out.append({"tool_calls": [d.to_openai() for d in tool_deltas]})
        return out

    done_list: list[FinishEvent] = []
    try:
        for index in range(len(choices.requests)):
            state = states[index]
            yield chunk(index, {"role": "assistant", "content": ""})
            async for reply in choices.replies(index):
                if isinstance(reply, TokenEvent):
                    logprobs = chat_logprobs(model, [reply.token_id], [reply.logprob]) if want_logprobs else None
                    parts = deltas_of(*state.feed(reply.text))
                    for part in parts:
                        yield chunk(index, part, logprobs=logprobs)
                        logprobs = None
                    if logprobs is not None and logprobs["content"]:
                        yield chunk(index, {}, logprobs=logprobs)
                else:
                    parts = deltas_of(*state.feed(reply.text)) + deltas_of(
                        *state.finish(truncated=reply.finish_reason == "length"))
                    for part in parts:
                        yield chunk(index, part)
                    done_list.append(reply)
                    yield chunk(index, {}, finish_reason_of(reply, state))
        if body.stream_options is not None and body.stream_options.include_usage:
            yield sse({**base, "choices": [], "usage": usage_body(record.prompt_tokens, done_list),
                       "timings": timings_body(done_list)})
        yield sse("[DONE]")
    except Exception as exc:  # after the first byte: an error event, then [DONE]
        from basert.server.errors import to_api_error

        yield sse(to_api_error(exc).body())
        yield sse("[DONE]")
    finally:
        choices.close()
        record.absorb(done_list)


# --- completions --------------------------------------------------------------------------------

async def completion(model: ServedModel, body: CompletionRequest, limits: ServerLimits, record: RequestRecord):
    """A text_completion object, or an async iterator of SSE chunks when streaming."""
    prompts = completion_prompts(model, body)
    for prompt in prompts:
        check_prompt_ids(model, prompt)
    want_logprobs = body.logprobs is not None
    response_id = new_id("cmpl")
    requests = []
    for p_index, prompt in enumerate(prompts):
        requests += engine_requests(model, body, prompt, max_tokens_of(body), limits, logprobs=want_logprobs,
                                    top_logprobs=body.logprobs or 0, id_prefix=f"{response_id}-{p_index}")
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
            "timings": timings_body(done_list), "system_fingerprint": model.info.fingerprint}


async def stream_completion(model: ServedModel, body: CompletionRequest, choices: ChoiceSet, response_id: str,
                            created: int, echo_text: list[str], record: RequestRecord) -> AsyncIterator[bytes]:
    base = {"id": response_id, "object": "text_completion", "created": created, "model": model.info.id}
    done_list: list[FinishEvent] = []
    try:
        for index in range(len(choices.requests)):
            if echo_text[index]:
                yield sse({**base, "choices": [{"index": index, "text": echo_text[index], "finish_reason": None,
                                                "logprobs": None}]})
            async for reply in choices.replies(index):
                finish = reply.finish_reason if isinstance(reply, FinishEvent) else None
                logprobs = None
                if isinstance(reply, TokenEvent) and body.logprobs is not None:
                    logprobs = completion_logprobs(model, [reply.token_id], [reply.logprob], 0)
                if reply.text or finish or logprobs:
                    yield sse({**base, "choices": [{"index": index, "text": reply.text, "finish_reason": finish,
                                                    "logprobs": logprobs}]})
                if isinstance(reply, FinishEvent):
                    done_list.append(reply)
        if body.stream_options is not None and body.stream_options.include_usage:
            yield sse({**base, "choices": [], "usage": usage_body(record.prompt_tokens, done_list),
                       "timings": timings_body(done_list)})
        yield sse("[DONE]")
    except Exception as exc:
        from basert.server.errors import to_api_error

        yield sse(to_api_error(exc).body())
        yield sse("[DONE]")
    finally:
        choices.close()
        record.absorb(done_list)

