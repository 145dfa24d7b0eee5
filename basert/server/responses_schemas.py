"""Request bodies of OpenAI's Responses API (pydantic): the request, its input items, tools and text format."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from basert.server.schemas import Lenient

# OpenAI's limits on `metadata`: at most 16 pairs, keys up to 64 characters, values up to 512.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512


class TextPart(Lenient):
    """A text part of a message: what the user wrote (`input_text`) or what the model answered (`output_text`)."""

    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(Lenient):
    """A message of the conversation; `type` may be left out, as OpenAI allows."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]


class FunctionCallItem(Lenient):
    """A function call the model made in an earlier turn."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1, max_length=128)
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(Lenient):
    """The result of a function call, sent back to the model."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[TextPart]


class ReasoningText(Lenient):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(Lenient):
    """The model's reasoning in an earlier turn; its `content` text goes back to the template, the summary does not."""

    type: Literal["reasoning"]
    content: list[ReasoningText] | None = None
    id: str | None = None


def item_kind(value: Any) -> str:
    """The `type` of an input item; a message may leave it out."""
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", "message")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(item_kind),
]


class FunctionToolSpec(Lenient):
    """A function tool in the Responses form: name, description and parameters beside the type."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(Lenient):
    type: Literal["function"]
    name: str


class TextFormat(Lenient):
    """`text.format`: plain text, any JSON object, or JSON matching `schema`."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    @model_validator(mode="after")
    def schema_present(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("a text format of type json_schema needs a schema")
        return self


class TextConfig(Lenient):
    format: TextFormat = Field(default_factory=lambda: TextFormat(type="text"))


class ReasoningConfig(Lenient):
    """`reasoning`: the effort maps to the template's `enable_thinking` ("none": off, any other: on)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None


class ResponsesRequest(Lenient):
    model: str | None = None
    input: str | list[InputItem] = Field(default_factory=list)
    instructions: str | None = None
    tools: list[FunctionToolSpec] | None = None
    tool_choice: Literal["auto", "none", "required"] | FunctionToolChoice = "auto"
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    text: TextConfig = Field(default_factory=TextConfig)
    reasoning: ReasoningConfig | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None

    @field_validator("metadata")
    @classmethod
    def metadata_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return None
        if len(value) > MAX_METADATA_PAIRS:
            raise ValueError(f"metadata holds at most {MAX_METADATA_PAIRS} pairs")
        if any(len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE for k, v in value.items()):
            raise ValueError(f"metadata keys are at most {MAX_METADATA_KEY} characters, values "
                             f"{MAX_METADATA_VALUE}")
        return value
