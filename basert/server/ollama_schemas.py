"""Ollama API request bodies (pydantic), validated at the HTTP boundary; unknown fields (and unknown `options`, as
Ollama ignores them) are accepted and ignored."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StrictInt, field_validator, model_validator

from basert.server.schemas import KeepAlive, Lenient, Tool

# `think` as Ollama takes it: on or off, or a reasoning effort (gpt-oss), which turns thinking on.
Think = bool | Literal["low", "medium", "high"]


class Options(Lenient):
    """Ollama's `options`: the sampler's, `num_predict` and `num_ctx`; the others (num_gpu, num_thread, mirostat,
    …) are accepted and ignored. Bounds are those of the OpenAI routes' fields."""

    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_k: int | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = None
    num_predict: int | None = Field(default=None, ge=-2)     # -1 (no limit) and -2 (fill the context): the default
    stop: list[Annotated[str, Field(min_length=1)]] | None = Field(default=None, max_length=16)
    repeat_penalty: float | None = Field(default=None, ge=1e-6, le=1e6)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    num_ctx: int | None = Field(default=None, ge=1)


class ModelRequest(Lenient):
    """A body that names a model: `model`, or the older `name`."""

    model: str = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def older_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and "model" not in data and "name" in data:
            return {**data, "model": data["name"]}
        return data


class KeptAlive(ModelRequest):
    """A body with `keep_alive`: a duration ("5m", "1h30m", "-1m") or seconds, parsed into seconds."""

    keep_alive: KeepAlive = None


class GenerationFields(KeptAlive):
    """What /api/chat and /api/generate share."""

    format: str | dict[str, Any] | None = None
    options: Options | None = None
    stream: bool = True                     # Ollama streams unless told not to
    think: Think | None = None
    logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0, le=20)

    @field_validator("format")
    @classmethod
    def json_or_schema(cls, value: str | dict | None) -> str | dict | None:
        if isinstance(value, str) and value not in ("", "json"):
            raise ValueError('format must be "json" or a JSON schema')
        return value


class ToolCallFunction(Lenient):
    name: str = Field(min_length=1, max_length=128)
    arguments: dict[str, Any] = Field(default_factory=dict)


class ToolCall(Lenient):
    id: str | None = None
    function: ToolCallFunction


def refused(value: Any, why: str) -> Any:
    """`value` when it is empty (or absent), else a ValueError saying `why` it is refused."""
    if value:
        raise ValueError(why)
    return value


IMAGES_REFUSED = "images are not supported: the models BaseRT serves read text only"


class ChatMessage(Lenient):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    thinking: str | None = None
    images: list[Any] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None

    @field_validator("images")
    @classmethod
    def no_images(cls, value: list | None) -> list | None:
        return refused(value, IMAGES_REFUSED)


class ChatRequest(GenerationFields):
    """The body of /api/chat; no messages: load the model (or with keep_alive 0, unload it)."""

    messages: list[ChatMessage] = Field(default_factory=list)
    tools: list[Tool] | None = None


class GenerateRequest(GenerationFields):
    """The body of /api/generate; an empty prompt: load the model (or with keep_alive 0, unload it)."""

    prompt: str = ""
    system: str | None = None
    raw: bool = False
    context: list[StrictInt] | None = None  # token ids of an earlier answer: the prompt continues them
    suffix: str | None = None
    template: str | None = None
    images: list[Any] | None = None

    @field_validator("suffix")
    @classmethod
    def no_suffix(cls, value: str | None) -> str | None:
        return refused(value, "fill-in-the-middle (suffix) is not supported")

    @field_validator("template")
    @classmethod
    def no_template(cls, value: str | None) -> str | None:
        return refused(value, "Ollama's Go templates are not supported: the model's chat template is used")

    @field_validator("images")
    @classmethod
    def no_images(cls, value: list | None) -> list | None:
        return refused(value, IMAGES_REFUSED)


class EmbedRequest(KeptAlive):
    """The body of /api/embed."""

    input: str | list[str] = Field(default_factory=list)
    truncate: bool = True                   # cut inputs longer than the context; false: such an input is a 400
    dimensions: int | None = Field(default=None, ge=1)


class EmbeddingsRequest(KeptAlive):
    """The body of the older /api/embeddings."""

    prompt: str = ""


class PullRequest(ModelRequest):
    stream: bool = True
    insecure: bool = False                  # accepted: models are converted from local packages
