"""One reply as it is generated: generated text split into reasoning, content and tool calls, and the assistant
message it makes.

The server's chat APIs and `basert.Model.chat` both parse their output here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from basert.chat.prompt import ChatPlan
from basert.chat.reasoning import ReasoningParser
from basert.chat.tool_calls import ToolCall, ToolCallDelta, ToolCallParser, make_tool_parser

if TYPE_CHECKING:
    from basert.engine.sampler import TokenLogprob


@dataclass(slots=True)
class ChatChoiceState:
    """Per-choice parsers (one instance per request and choice) and what they produced."""

    reasoning: ReasoningParser | None
    tools: ToolCallParser | None
    content: str = ""
    reasoning_text: str = ""
    ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)

    @classmethod
    def for_plan(cls, plan: ChatPlan, dialect: str) -> ChatChoiceState:
        """Fresh parsers for one choice of a planned prompt: reasoning where the template thinks, tool calls in
        `dialect` where the output may call tools."""
        return cls(
            ReasoningParser(starts_in_reasoning=plan.starts_in_reasoning) if plan.has_reasoning else None,
            make_tool_parser(dialect, plan.tools) if plan.tools else None,
        )

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
        """End of generation (`truncated`: cut off by the token limit): what the parsers held back."""
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

    def finish_reason(self, engine_reason: str) -> str:
        """The choice's finish reason: "tool_calls" when it stopped after making calls, else the engine's."""
        if self.tool_calls and engine_reason == "stop":
            return "tool_calls"
        return engine_reason

    def message(self) -> dict:
        """The OpenAI assistant message of the finished choice."""
        return assistant_message(self.content, self.reasoning_text, self.tool_calls)


class TurnEnd:
    """Where the engine ends a turn that may call tools: once `max_calls` call bodies closed, or when a call repeats an
    earlier one of the turn (see ToolCallParser). It runs the reply's own parsers over the engine's output text, so
    generation stops on the very token where the reply's parsers end the turn."""

    __slots__ = ("_fed", "_max_calls", "_state")

    def __init__(self, plan: ChatPlan, dialect: str, max_calls: int) -> None:
        self._state = ChatChoiceState.for_plan(plan, dialect)
        self._max_calls = max_calls
        self._fed = 0

    def reached(self, text: str) -> bool:
        """Whether the output `text` so far (it only grows) ends the turn."""
        self._state.feed(text[self._fed:])
        self._fed = len(text)
        tools = self._state.tools
        return tools is not None and (tools.turn_over or tools.closed >= self._max_calls)


def assistant_message(content: str, reasoning: str, tool_calls: list[ToolCall]) -> dict:
    """An OpenAI assistant message: `content` None when the reply is only tool calls, `reasoning_content` and
    `tool_calls` when there are any."""
    message: dict = {"role": "assistant", "content": content if (content or not tool_calls) else None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = [call.to_openai() for call in tool_calls]
    return message
