"""The chat driver every chat-shaped API shares: render a conversation, submit one engine request per choice, and
turn the engine's tokens into per-choice events (reasoning text, content text, tool-call pieces, the finish).

OpenAI chat completions, Anthropic messages and OpenAI responses translate their request into a
`ChatCompletionRequest`, call `start_chat`, and format the `ChatRun`'s events: a streamed response writes them as
they come, a complete one collects them first (`ChatRun.results`), so the two forms always agree. The rendering
(`basert.chat.prompt`) and the per-choice parsers (`basert.chat.reply`) are shared with `basert.Model.chat`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from basert.chat.prompt import ChatPlan, plan_chat_prompt
from basert.chat.reply import ChatChoiceState, TurnEnd
from basert.chat.template import ChatTemplate
from basert.chat.tool_calls import ToolCallDelta, check_forced_tool, max_calls_per_turn
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
from basert.tokenizer import Tokenizer

# --- rendering ----------------------------------------------------------------------------------


def continues_final_message(body: ChatCompletionRequest) -> bool:
    """Whether the prompt continues the final message (an assistant prefill) rather than opening a new turn.

    A final assistant message is continued unless `continue_final_message` is false; asking to continue any other
    final message, or to continue one and also open a new turn (`add_generation_prompt: true` set by the request,
    not by default), is a 400.
    """
    final_is_assistant = body.messages[-1].role == "assistant"
    if body.continue_final_message and not final_is_assistant:
        raise invalid("continue_final_message needs a final assistant message", "continue_final_message")
    if body.continue_final_message and body.add_generation_prompt and "add_generation_prompt" in body.model_fields_set:
        raise invalid("continue_final_message and add_generation_prompt cannot both be true: a continued message "
                      "opens no new turn", "continue_final_message")
    return final_is_assistant and body.continue_final_message is not False


def plan_chat(model: ServedModel, body: ChatCompletionRequest) -> ChatPlan:
    """Render the conversation (with tools) through the model's template and tokenize it."""
    return render_chat(model.require_template(), model.require_tokenizer(), body,
                       segment_ends=model.wants_segment_ends)


def render_chat(template: ChatTemplate, tokenizer: Tokenizer, body: ChatCompletionRequest, *,
                segment_ends: bool = False) -> ChatPlan:
    """`plan_chat` for a template and tokenizer held outside a served model (the cluster's router)."""
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    return plan_chat_prompt(template, tokenizer, messages, tools, may_call=body.tool_choice != "none",
                            template_kwargs=body.chat_template_kwargs, constrained=is_constrained(body, tools),
                            continue_final=continues_final_message(body),
                            add_generation_prompt=body.add_generation_prompt, segment_ends=segment_ends)


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
    return max_calls_per_turn(body.parallel_tool_calls, name)


def constraint_factory_for(model: ServedModel, body: ChatCompletionRequest, tools: list[dict] | None):
    """A per-choice grammar matcher factory for forced tool calls, constrained output formats and `tool_choice`
    "none" with tools (no call may open; a format's grammar alone when one is given: its output is no call), or
    None."""
    forced, forced_name = forced_tool(body)
    if forced:
        check_forced_tool(tools, forced_name)
        factory = model.grammar_factory()
        grammar = factory.tool_call(tools, model.dialect, name=forced_name, max_calls=calls_allowed(body))
        return lambda: factory.matcher(grammar)
    grammar = output_grammar(model, body)
    if grammar is None and body.tools and body.tool_choice == "none":
        grammar = model.grammar_factory().no_tool_call()
    if grammar is None:
        return None
    factory = model.grammar_factory()
    return lambda: factory.matcher(grammar)


# --- per-choice output --------------------------------------------------------------------------


@dataclass(slots=True)
class ChoiceDelta:
    """New output of one choice; `logprobs` is the OpenAI chat form for the tokens it came from, when asked for."""

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
        self.states = [ChatChoiceState.for_plan(plan, model.dialect) for _ in choices.requests]

    async def events(self) -> AsyncIterator[ChoiceDelta | ChoiceEnd]:
        """The choices' deltas and ends, choice after choice; an engine failure is raised. Cancels what is left of
        the request when the consumer stops early.

        A token's logprobs go out with the delta that carries its text: while its text is held back (for a
        possible stop string, by a parser) they wait, and the delta that releases it carries them all.
        """
        try:
            for index, state in enumerate(self.states):
                unsent = 0      # the last tokens of state.ids whose logprobs have not gone out
                async for reply in self.choices.replies(index):
                    if isinstance(reply, TokenEvent):
                        state.ids.append(reply.token_id)
                        state.logprobs.append(reply.logprob)
                        unsent += 1
                        delta = ChoiceDelta(index, *state.feed(reply.text))
                        if delta.reasoning or delta.content or delta.tool_calls:
                            delta.logprobs, unsent = self._logprobs(state, unsent), 0
                            yield delta
                        continue
                    reasoning, content, calls = state.feed(reply.text)
                    more_reasoning, more_content, more_calls = state.finish(truncated=reply.finish_reason == "length")
                    delta = ChoiceDelta(index, reasoning + more_reasoning, content + more_content, calls + more_calls)
                    if delta.reasoning or delta.content or delta.tool_calls or (self.want_logprobs and unsent):
                        delta.logprobs = self._logprobs(state, unsent)
                        yield delta
                    self.done_list.append(reply)
                    yield ChoiceEnd(index, state.finish_reason(reply.finish_reason), state, reply)
        finally:
            self.choices.close()
            self.record.absorb(self.done_list)

    def _logprobs(self, state: ChatChoiceState, count: int) -> dict | None:
        """The OpenAI chat logprobs of a choice's last `count` tokens, when the request asked for logprobs."""
        if not self.want_logprobs:
            return None
        start = len(state.ids) - count
        return chat_logprobs(self.model, state.ids[start:], state.logprobs[start:])

    async def results(self) -> list[ChoiceEnd]:
        """Run to the end; every choice's end."""
        return [event async for event in self.events() if isinstance(event, ChoiceEnd)]

    def usage(self) -> dict:
        return usage_body(len(self.plan.prompt), self.done_list)

    def timings(self) -> dict:
        return timings_body(self.done_list)


async def start_chat(model: ServedModel, body: ChatCompletionRequest, limits: ServerLimits, record: RequestRecord,
                     id_prefix: str = "chatcmpl") -> ChatRun:
    """Render and submit a chat request; returns once its first choice has started, so that a refusal (a bad
    conversation, a busy slot, a context overflow) is raised before any response byte."""
    plan = plan_chat(model, body)
    want_logprobs = body.logprobs or body.top_logprobs > 0
    response_id = new_id(id_prefix)
    stop_after = (lambda: TurnEnd(plan, model.dialect, calls_allowed(body))) if plan.tools else None
    requests = engine_requests(model, body, plan.prompt, max_tokens_of(body), limits,
                               logprobs=want_logprobs, top_logprobs=body.top_logprobs,
                               constraint_factory=constraint_factory_for(model, body, plan.tools),
                               id_prefix=response_id, segment_ends=plan.segment_ends, stop_after=stop_after)
    record.prompt_tokens = len(plan.prompt)
    choices = ChoiceSet(model, requests)
    await choices.submit(body.id_slot)
    await choices.started()
    return ChatRun(model, body, plan, choices, record, response_id)
