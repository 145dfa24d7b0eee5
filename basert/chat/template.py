"""Renders a model's Jinja chat template into prompt text, in the sandbox and dialect HF transformers uses.

OpenAI-shaped messages are normalised first into the shapes HF-era templates expect.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from basert.errors import InvalidRequestError


class ChatTemplateError(InvalidRequestError, ValueError):
    """A chat template failed to compile or render, or rejected the conversation itself."""


def _raise_exception(message: str) -> NoReturn:
    """The `raise_exception` global templates call to reject a conversation."""
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """HF's `tojson` filter: Jinja's own would HTML-escape `<`, `>`, `&` and `'` inside prompts."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    """The `strftime_now` global: the current local time, formatted."""
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    # The same settings as transformers' _compile_jinja_template, so whitespace matches HF exactly.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()


class ChatTemplate:
    """A chat template compiled once, rendered per request."""

    __slots__ = ("_source", "_template", "_bos_token", "_eos_token", "_supports_tools")

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        self._source = source
        try:
            ast = _ENV.parse(source)
            self._template = _ENV.from_string(ast)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"chat template syntax error at line {exc.lineno}: {exc.message}") from exc
        self._bos_token = bos_token
        self._eos_token = eos_token
        # Reading the AST rather than the text: a literal "<tools>" in a prompt is not tool support.
        self._supports_tools = "tools" in jinja2.meta.find_undeclared_variables(ast)

    @property
    def source(self) -> str:
        """The template's Jinja text."""
        return self._source

    @property
    def supports_tools(self) -> bool:
        """Whether the template reads the `tools` variable."""
        return self._supports_tools

    def render(
        self,
        messages: list[dict],
        /,
        *,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render OpenAI-shaped messages (and tools) into the prompt text.

        `self` and `messages` are positional-only, so template variables of those names land in `template_kwargs`.
        """
        # Same variables as HF apply_chat_template: `tools` is always defined (None when absent),
        # special tokens first so that explicit kwargs override them.
        variables = {
            "bos_token": self._bos_token,
            "eos_token": self._eos_token,
            **template_kwargs,
            "messages": [_normalise_message(message) for message in messages],
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(variables)
        except ChatTemplateError:
            raise
        except Exception as exc:
            # A template is foreign code: whatever it raises is a bad template or a conversation
            # it cannot express, never a server fault, so it leaves as one exception type.
            raise ChatTemplateError(f"chat template failed to render: {type(exc).__name__}: {exc}") from exc


def _normalise_message(message: dict) -> dict:
    normalised = dict(message)
    normalised["content"] = content_text(message.get("content"))
    if message.get("tool_calls"):
        normalised["tool_calls"] = [_normalise_tool_call(call) for call in message["tool_calls"]]
    return normalised


def content_text(content: str | list[dict] | None) -> str:
    """A message's content as the text a template sees: parts joined by newlines, None as empty."""
    # Templates call string methods on content (Qwen3: `'</think>' in message.content`), so an
    # assistant turn with only tool calls gets "" rather than None, as vLLM does.
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.get("type") != "text":
            raise ChatTemplateError(f"unsupported message content part type {part.get('type')!r}")
        texts.append(part["text"])
    # Newline-joined, as vLLM does, so separate parts do not run into each other.
    return "\n".join(texts)


def _normalise_tool_call(call: dict) -> dict:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    return {**call, "function": {**function, "arguments": _parse_arguments(function["arguments"])}}


def _parse_arguments(arguments: str) -> dict | str:
    # OpenAI clients send arguments as a JSON string; templates iterate `arguments|items`.
    # An empty string is what some clients send for a call without arguments.
    if not arguments.strip():
        return {}
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


def model_chat_template(tokenizer, template_file: Path | None = None) -> ChatTemplate | None:
    """The template a model is served with: `template_file`'s (--chat-template), else the one its tokenizer
    brings, with the tokenizer's BOS/EOS text; None when there is neither."""
    source = template_file.read_text() if template_file else (tokenizer.chat_template if tokenizer else None)
    if not source:
        return None
    return ChatTemplate(source, bos_token=tokenizer.bos_token or "" if tokenizer else "",
                        eos_token=tokenizer.eos_token or "" if tokenizer else "")
