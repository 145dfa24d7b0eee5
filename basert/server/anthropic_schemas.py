"""Anthropic Messages request bodies (pydantic), validated at the HTTP boundary; unknown fields (`metadata`,
`cache_control`, …) are accepted and ignored."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from basert.server.schemas import Lenient


class TextBlock(Lenient):
    type: Literal["text"]
    text: str


class ToolUseBlock(Lenient):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(Lenient):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] = ""
    is_error: bool = False


class ThinkingBlock(Lenient):
    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(Lenient):
    type: Literal["redacted_thinking"]
    data: str = ""


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                         Field(discriminator="type")]

# The blocks each role may send: results of tool calls come from the user, calls and thinking from the assistant.
ROLE_BLOCKS = {"user": {"text", "tool_result"}, "assistant": {"text", "tool_use", "thinking", "redacted_thinking"}}


class InputMessage(Lenient):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    @model_validator(mode="after")
    def blocks_fit_role(self) -> InputMessage:
        if isinstance(self.content, list):
            for block in self.content:
                if block.type not in ROLE_BLOCKS[self.role]:
                    raise ValueError(f"a {self.role} message cannot hold a {block.type} block")
        return self


class ToolDefinition(Lenient):
    type: Literal["custom"] | None = None       # server tools (web search, bash, …) are not supported
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def tool_has_name(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice of type tool needs the tool's name")
        return self

    @property
    def forces_call(self) -> bool:
        return self.type in ("any", "tool")


class ThinkingConfig(Lenient):
    type: Literal["enabled", "adaptive", "between_tools", "disabled"]
    budget_tokens: int | None = None            # accepted; generation is bounded by max_tokens alone

    @property
    def enabled(self) -> bool:
        return self.type != "disabled"


class MessagesInput(Lenient):
    """What decides the prompt: the body of /v1/messages/count_tokens, and the core of /v1/messages."""

    model: str | None = None
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None

    @model_validator(mode="after")
    def thinking_not_forced(self) -> MessagesInput:
        # As Anthropic: a forced call starts the answer at once, which leaves no room for thinking first.
        if self.thinking is not None and self.thinking.enabled and self.tool_choice and self.tool_choice.forces_call:
            raise ValueError("thinking may not be enabled when tool_choice forces tool use")
        return self


class MessagesRequest(MessagesInput):
    """The body of /v1/messages."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = Field(default=None, max_length=16)
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    stream: bool = False
