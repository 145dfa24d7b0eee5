"""The chat driver every chat-shaped API shares: render a conversation, submit one engine request per choice, and
turn the engine's tokens into per-choice events (reasoning text, content text, tool-call pieces, the finish).

OpenAI chat completions, Anthropic messages and OpenAI responses translate their request into a
`ChatCompletionRequest`, call `start_chat`, and format the `ChatRun`'s events: a streamed response writes them as
they come, a complete one collects them first (`ChatRun.results`), so the two forms always agree.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from basert.chat.encoder import ChatEncoder
from basert.chat.reasoning import ReasoningParser, opens_in_prompt
from basert.chat.template import ChatTemplate, content_text
from basert.chat.tool_calls import (
    CLOSE_TAG,
    MAX_TOOL_CALLS_PER_TURN,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    inject_tool_prompt,
    make_tool_parser,
)
from basert.engine.sampler import TokenLogprob
from basert.engine.slots import common_prefix
from basert.engine.types import FinishEvent, TokenEvent
from basert.server.access_log import RequestRecord
from basert.server.catalog import ServedModel
from basert.server.errors import invalid
from basert.server.generation import (
    ChoiceSet,
    ServerLimits,
    chat_logprobs,
    engine_requests,
    max_tokens_of,
    new_id,
    output_grammar,
    timings_body,
    usage_body,
)
from basert.server.schemas import ChatCompletionRequest

# --- rendering ----------------------------------------------------------------------------------


@dataclass(slots=True)
class ChatPlan:
    prompt: list[int]
    tools: list[dict] | None
    starts_in_reasoning: bool
    has_reasoning: bool
    segment_ends: tuple[int, ...] = ()


def continues_final_message(body: ChatCompletionRequest) -> bool:
    """Whether the prompt continues the final message (an assistant prefill) rather than opening a new turn.

    A final assistant message is continued unless `continue_final_message` is false; asking to continue any other
    final message is a 400.
    """
    final_is_assistant = body.messages[-1].role == "assistant"
    if body.continue_final_message and not final_is_assistant:
        raise invalid("continue_final_message needs a final assistant message", "continue_final_message")
    return final_is_assistant and body.continue_final_message is not False


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
    template_tools = encoder.hide(template_tools)
    if continues_final_message(body):
        rendered = render_prefill(template, messages, template_tools, kwargs)
    else:
        rendered = template.render(messages, tools=template_tools, add_generation_prompt=body.add_generation_prompt,
                                   **kwargs)
    prompt = encoder.encode(rendered)
    has_reasoning = "<think>" in (tokenizer.chat_template or "") or "<think>" in rendered
    segment_ends = ()
    if model.wants_segment_ends:
        segment_ends = message_boundaries(encoder, messages, rendered, prompt)
    return ChatPlan(prompt, use_tools, opens_in_prompt(rendered), has_reasoning, segment_ends)


def render_prefill(template: ChatTemplate, messages: list[dict], tools: list[dict] | None, kwargs: dict) -> str:
    """The prompt that continues the final message: the conversation rendered with it, cut right after its text
    (the template's end-of-turn markup dropped); where the template changes that text, the conversation before it
    with a generation prompt, then the text."""
    text = content_text(messages[-1].get("content"))
    if text:
        closed = template.render(messages, tools=tools, add_generation_prompt=False, **kwargs)
        at = closed.rfind(text)
        if at >= 0:
            return closed[: at + len(text)]
    return template.render(messages[:-1], tools=tools, add_generation_prompt=True, **kwargs) + text


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


def forced_tool(body: ChatCompletionRequest) -> tuple[bool, str | None]:
    """(a call is required, the name it must have) from `tool_choice`."""
    choice = body.tool_choice
    name = choice.function.name if hasattr(choice, "function") else None
    return choice == "required" or name is not None, name


def is_constrained(body: ChatCompletionRequest, tools: list[dict] | None) -> bool:
    """True when a grammar will shape the output (a forced tool call, a grammar, a schema or a JSON format)."""
    forced, _ = forced_tool(body)
    return (forced and bool(tools)) or body.output_constraint() is not None


def calls_allowed(body: ChatCompletionRequest) -> int:
    """The most tool calls one turn may make: one with `parallel_tool_calls` false or a named tool_choice."""
    _, name = forced_tool(body)
    return MAX_TOOL_CALLS_PER_TURN if body.parallel_tool_calls and name is None else 1


def constraint_factory_for(model: ServedModel, body: ChatCompletionRequest, tools: list[dict] | None):
    """A per-choice grammar matcher factory for forced tool calls and constrained output formats, or None."""
    forced, forced_name = forced_tool(body)
    if forced and not tools:
        raise invalid("tool_choice requires tools", "tool_choice")
    if forced:
        if forced_name and forced_name not in {t["function"]["name"] for t in tools}:
            raise invalid(f"tool_choice names {forced_name!r}, which is not in tools", "tool_choice")
        factory = model.grammar_factory()
        grammar = factory.tool_call(tools, model.dialect, name=forced_name, max_calls=calls_allowed(body))
        return lambda: factory.matcher(grammar)
    grammar = output_grammar(model, body)
    if grammar is None:
        return None
    factory = model.grammar_factory()
    return lambda: factory.matcher(grammar)


# --- per-choice output --------------------------------------------------------------------------


@dataclass(slots=True)
class ChatChoiceState:
    """Per-choice parsers (one instance per request and choice) and what they produced."""

    reasoning: ReasoningParser | None
    tools: ToolCallParser | None
    content: str = ""
    reasoning_text: str = ""
    ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, str, list[ToolCallDelta]]:
        """Split new text into (reasoning delta, content delta, tool-call deltas)."""
        reasoning_delta, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        deltas = []
        if self.tools is not None and content:
            events = self.tools.feed(content)
            content, deltas = events.content, events.tool_deltas
        self.reasoning_text += reasoning_delta
        self.content += content
        return reasoning_delta, content, deltas

    def finish(self, truncated: bool) -> tuple[str, str, list[ToolCallDelta]]:
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
    def tool_calls(self) -> list[ToolCall]:
        return self.tools.tool_calls if self.tools is not None else []


@dataclass(slots=True)
class ChoiceDelta:
    """New output of one choice; `logprobs` is the OpenAI chat form for the token it came from, when asked for."""

    index: int
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    logprobs: dict | None = None


@dataclass(slots=True)
class ChoiceEnd:
    """The end of one choice: why it ended ("stop", "length" or "tool_calls"), all it produced, the engine's event."""

    index: int
    finish_reason: str
    state: ChatChoiceState
    done: FinishEvent


class ChatRun:
    """One chat request submitted to its model: `events()` runs it to the end, then `usage()` and `timings()`."""

    def __init__(self, model: ServedModel, body: ChatCompletionRequest, plan: ChatPlan, choices: ChoiceSet,
                 record: RequestRecord, response_id: str):
        self.model = model
        self.body = body
        self.plan = plan
        self.choices = choices
        self.record = record
        self.response_id = response_id
        self.created = int(time.time())
        self.want_logprobs = body.logprobs or body.top_logprobs > 0
        self.done_list: list[FinishEvent] = []
        self.states = [
            ChatChoiceState(
                ReasoningParser(starts_in_reasoning=plan.starts_in_reasoning) if plan.has_reasoning else None,
                make_tool_parser(model.dialect, plan.tools) if plan.tools else None,
            )
            for _ in choices.requests
        ]

    async def events(self) -> AsyncIterator[ChoiceDelta | ChoiceEnd]:
        """The choices' deltas and ends, choice after choice; an engine failure is raised. Cancels what is left of
        the request when the consumer stops early."""
        try:
            for index, state in enumerate(self.states):
                async for reply in self.choices.replies(index):
                    if isinstance(reply, TokenEvent):
                        state.ids.append(reply.token_id)
                        state.logprobs.append(reply.logprob)
                        logprobs = None
                        if self.want_logprobs:
                            logprobs = chat_logprobs(self.model, [reply.token_id], [reply.logprob])
                        delta = ChoiceDelta(index, *state.feed(reply.text), logprobs=logprobs)
                        if delta.reasoning or delta.content or delta.tool_calls or (logprobs and logprobs["content"]):
                            yield delta
                        continue
                    reasoning, content, calls = state.feed(reply.text)
                    more_reasoning, more_content, more_calls = state.finish(truncated=reply.finish_reason == "length")
                    delta = ChoiceDelta(index, reasoning + more_reasoning, content + more_content, calls + more_calls)
                    if delta.reasoning or delta.content or delta.tool_calls:
                        yield delta
                    self.done_list.append(reply)
                    yield ChoiceEnd(index, finish_reason_of(reply, state), state, reply)
        finally:
            self.choices.close()
            self.record.absorb(self.done_list)

    async def results(self) -> list[ChoiceEnd]:
        """Run to the end; every choice's end."""
        return [event async for event in self.events() if isinstance(event, ChoiceEnd)]

    def usage(self) -> dict:
        return usage_body(len(self.plan.prompt), self.done_list)

    def timings(self) -> dict:
        return timings_body(self.done_list)


def finish_reason_of(done: FinishEvent, state: ChatChoiceState) -> str:
    if state.tool_calls and done.finish_reason == "stop":
        return "tool_calls"
    return done.finish_reason


async def start_chat(model: ServedModel, body: ChatCompletionRequest, limits: ServerLimits, record: RequestRecord,
                     id_prefix: str = "chatcmpl") -> ChatRun:
    """Render and submit a chat request; returns once its first choice has started, so that a refusal (a bad
    conversation, a busy slot, a context overflow) is raised before any response byte."""
    plan = plan_chat(model, body)
    want_logprobs = body.logprobs or body.top_logprobs > 0
    response_id = new_id(id_prefix)
    stop_after = (CLOSE_TAG, calls_allowed(body)) if plan.tools else None
    requests = engine_requests(model, body, plan.prompt, max_tokens_of(body), limits,
                               logprobs=want_logprobs, top_logprobs=body.top_logprobs,
                               constraint_factory=constraint_factory_for(model, body, plan.tools),
                               id_prefix=response_id, segment_ends=plan.segment_ends, stop_after=stop_after)
    record.prompt_tokens = len(plan.prompt)
    choices = ChoiceSet(model, requests)
    await choices.submit(body.id_slot)
    await choices.started()
    return ChatRun(model, body, plan, choices, record, response_id)
