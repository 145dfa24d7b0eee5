"""Request bodies (pydantic), validated at the HTTP boundary; unknown fields are accepted and ignored."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    field_validator,
    model_validator,
)

from basert.engine.drafts import MAX_DRAFT_MAX
from basert.server.catalog import parse_keep_alive

# Token ids as logit_bias keys: ASCII digits only ("²", "①" and "٣" are digits to str.isdigit).
TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,12}")
# Template variables a request may not set through chat_template_kwargs: the server sets them.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt"})


class Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class FunctionDefinition(Lenient):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(Lenient):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoiceFunction(Lenient):
    name: str


class NamedToolChoice(Lenient):
    type: Literal["function"] = "function"
    function: NamedToolChoiceFunction


class JsonSchemaFormat(Lenient):
    name: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(Lenient):
    """OpenAI's `{"type": "json_schema", "json_schema": {"schema": …}}`, or llama.cpp's `schema` beside the type."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")

    @model_validator(mode="after")
    def schema_present(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None and self.schema_ is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self

    def constraint(self) -> tuple[str, Any] | None:
        """("json_schema", schema), ("json_object", None), or None for text."""
        if self.type == "text":
            return None
        schema = self.json_schema.schema_ if self.json_schema is not None else self.schema_
        if schema is not None:
            return "json_schema", schema
        return "json_object", None


class StreamOptions(Lenient):
    include_usage: bool = False


class TextPart(Lenient):
    type: Literal["text"]
    text: str


class Message(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class SamplingFields(Lenient):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    n_predict: int | None = Field(default=None, ge=-1)   # llama.cpp's max_tokens; -1: the server's default
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    # Divides or multiplies float32 logits: far outside [1e-6, 1e6] it turns them into inf and NaN.
    repeat_penalty: float = Field(default=1.0, ge=1e-6, le=1e6)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=8)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    id_slot: int | None = Field(default=None, ge=-1)     # -1: any slot, as in llama.cpp
    ignore_eos: bool = False
    # Speculative decoding (the output is the same either way): false turns it off for this request;
    # llama.cpp's `speculative.n_max` lowers the most drafted tokens per step.
    speculative: StrictBool = True
    speculative_n_max: StrictInt | None = Field(default=None, ge=0, le=MAX_DRAFT_MAX, alias="speculative.n_max")
    # With --context-shift: the prompt tokens kept when the context is full (-1: all; default: the server's --keep).
    n_keep: StrictInt | None = Field(default=None, ge=-1)
    # Constrained output, one at a time: llama.cpp's GBNF `grammar` and `json_schema`, OpenAI's `response_format`.
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def one_output_constraint(self) -> SamplingFields:
        given = [name for name in ("grammar", "json_schema") if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            given.append("response_format")
        if len(given) > 1:
            raise ValueError(f"give at most one of grammar, json_schema and response_format, not {' and '.join(given)}")
        return self

    def output_constraint(self) -> tuple[str, Any] | None:
        """("gbnf", text), ("json_schema", schema), ("json_object", None), or None: what the output must match."""
        if self.grammar is not None:
            return "gbnf", self.grammar
        if self.json_schema is not None:
            return "json_schema", self.json_schema
        return self.response_format.constraint() if self.response_format is not None else None

    def token_budget(self) -> int | None:
        """max_tokens, or llama.cpp's n_predict (-1 and 0: the server's default)."""
        if self.max_tokens is not None:
            return self.max_tokens
        return self.n_predict if self.n_predict is not None and self.n_predict > 0 else None

    @field_validator("stop")
    @classmethod
    def stop_list(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if len(stops) > 16 or any(not s for s in stops):
            raise ValueError("stop must be up to 16 non-empty strings")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def bias_range(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is None:
            return None
        for key, bias in value.items():
            if not TOKEN_ID_KEY.fullmatch(key):
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError("logit_bias values must be between -100 and 100")
        return value


class ChatCompletionRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool | None = None    # None: a final assistant message is continued (a prefill)

    @field_validator("chat_template_kwargs")
    @classmethod
    def template_kwargs_allowed(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        reserved = sorted(RESERVED_TEMPLATE_VARIABLES & set(value or ()))
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}: the request's own fields do")
        return value


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]     # token ids: no true, no "1"
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=5)


class LlamaCompletionRequest(SamplingFields):
    """llama.cpp's native /completion: its prompt shapes, its sampling defaults and its own output options."""

    # A string; token ids; a mix of both ([12, "text", 34]); or a list of such prompts (one result each).
    prompt: str | list[StrictInt | str | list[StrictInt | str]]
    temperature: float = Field(default=0.8, ge=0.0, le=2.0)
    top_k: int = Field(default=40, ge=0)
    top_p: float = Field(default=0.95, gt=0.0, le=1.0)
    min_p: float = Field(default=0.05, ge=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=1)    # one result per prompt: send several prompts for several results
    n_probs: int = Field(default=0, ge=0, le=20)
    cache_prompt: bool = True
    return_tokens: bool = False
    response_fields: list[str] = Field(default_factory=list)     # e.g. ["content", "generation_settings/n_predict"]
    # Also llama.cpp's [[token, bias], ...]; a token is an id or a text (each of its tokens); false: never it.
    logit_bias: dict[str, float | bool] | list[tuple[StrictInt | str, float | bool]] | None = None

    @field_validator("logit_bias")
    @classmethod
    def bias_range(cls, value: dict | list | None) -> dict | list | None:
        """Biases within [-100, 100] or false; the server turns text into token ids."""
        pairs = value.items() if isinstance(value, dict) else value or ()
        if any(not isinstance(bias, bool) and not -100.0 <= bias <= 100.0 for _, bias in pairs):
            raise ValueError("logit_bias values must be between -100 and 100, or false")
        return value


class TokenizeRequest(Lenient):
    model: str | None = None
    content: str | None = None
    prompt: str | None = None
    add_special: bool = False
    parse_special: bool = True               # special-token text becomes control tokens, as in llama.cpp
    with_pieces: bool = False


class DetokenizeRequest(Lenient):
    model: str | None = None
    tokens: list[StrictInt]


class SlotFileRequest(Lenient):
    filename: str | None = None
    file_id: str | None = None


# Ollama's keep-alive: a duration ("5m", "1h30m", "-1m") or seconds, parsed into seconds (negative: forever).
KeepAlive = Annotated[float | None, BeforeValidator(lambda value: None if value is None else parse_keep_alive(value))]


class ModelActionRequest(Lenient):
    """POST /models/load and /models/unload (llama-server's router): the model, and for a load how long it stays."""

    model: str = Field(min_length=1)
    keep_alive: KeepAlive = None
