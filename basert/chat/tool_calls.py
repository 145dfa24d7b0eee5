"""Tool calls: the generic tool prompt, and streaming parsers that turn generated text into OpenAI tool calls.

Both dialects wrap a call in `<tool_call>` tags: Qwen3/Hermes put a JSON object inside, Qwen3.5/Qwen3-Coder an XML body.
"""

from __future__ import annotations

import json
import math
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any
from uuid import uuid4

from basert.chat.reasoning import partial_tag_length
from basert.errors import InvalidRequestError

QWEN_JSON = "qwen_json"
QWEN_XML = "qwen_xml"

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"

# The most tool calls one assistant turn may make: generation stops when the model closes that many. A weak model
# allowed more than one call can keep opening new ones until max_tokens (or repeating one: see ToolCallParser).
MAX_TOOL_CALLS_PER_TURN = 8

# The same wording as Qwen3's own template, so a model trained on that format recognises it.
GENERIC_TOOL_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


@dataclass(slots=True)
class ToolCall:
    """One complete tool call; `arguments` is a JSON object string."""

    id: str
    name: str
    arguments: str

    @property
    def parsed_arguments(self) -> dict[str, Any]:
        """The arguments as a dict."""
        return json.loads(self.arguments)

    def to_openai(self) -> dict:
        """The call as an entry of an OpenAI `message.tool_calls` list."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True)
class ToolCallDelta:
    """One streamed piece of a tool call: the first of a call has id and name, later ones only argument text."""

    index: int
    id: str | None
    name: str | None
    arguments: str

    def to_openai(self) -> dict:
        """The delta as an entry of an OpenAI streaming `delta.tool_calls` list."""
        function: dict[str, str] = {"arguments": self.arguments}
        if self.name is not None:
            function["name"] = self.name
        if self.id is None:
            return {"index": self.index, "function": function}
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": function,
        }


@dataclass(slots=True)
class ParserEvents:
    """What one `feed` or `finish` produced: content safe to stream now, and tool-call deltas."""

    content: str = ""
    tool_deltas: list[ToolCallDelta] = field(default_factory=list)


def detect_dialect(template_source: str | None) -> str:
    """The tool-call dialect a chat template teaches its model; the generic prompt teaches JSON."""
    if template_source is not None and (
        "<function=" in template_source or "<parameter=" in template_source
    ):
        return QWEN_XML
    return QWEN_JSON


def tool_system_prompt(tools: list[dict]) -> str:
    """The system-prompt text describing `tools`, for templates that do not render tools themselves."""
    described = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return GENERIC_TOOL_PROMPT.replace("{tools}", described)


def written_call(call: dict) -> str:
    """An earlier turn's tool call (OpenAI's shape) as the generic tool prompt asks the model to write one."""
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return "<tool_call>\n" + json.dumps({"name": function.get("name"), "arguments": arguments},
                                        ensure_ascii=False) + "\n</tool_call>"


def with_written_calls(message: dict) -> dict:
    """An assistant message whose tool calls are written into its content (a template without tool support
    renders the content only: the model would not see the calls it made)."""
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not calls:
        return message
    content = message.get("content")
    text = content if isinstance(content, str) else "".join(
        part.get("text", "") for part in content or () if isinstance(part, dict))
    written = "\n".join(written_call(call) for call in calls if isinstance(call, dict))
    rest = {key: value for key, value in message.items() if key != "tool_calls"}
    return {**rest, "content": f"{text}\n{written}" if text else written}


def inject_tool_prompt(messages: list[dict], tools: list[dict]) -> list[dict]:
    """A copy of `messages` whose system message starts with the generic tool prompt, and whose earlier tool calls
    are written into their turns as that prompt asks the model to write them."""
    prompt = tool_system_prompt(tools)
    messages = [with_written_calls(message) for message in messages]
    if not messages or messages[0].get("role") != "system":
        return [{"role": "system", "content": prompt}, *messages]
    system = messages[0]
    content = system.get("content")
    if isinstance(content, list):
        merged: str | list[dict] = [{"type": "text", "text": prompt}, *content]
    elif content:
        merged = f"{prompt}\n\n{content}"
    else:
        merged = prompt
    return [{**system, "content": merged}, *messages[1:]]


class ToolChoiceError(InvalidRequestError, ValueError):
    """A `tool_choice` that the request's tools cannot meet."""

    param = "tool_choice"


def check_forced_tool(tools: list[dict] | None, name: str | None) -> None:
    """Raise ToolChoiceError unless `tools` can meet a forced call (of the function `name`, when one is named)."""
    if not tools:
        raise ToolChoiceError("tool_choice requires tools")
    if name and name not in {tool["function"]["name"] for tool in tools}:
        raise ToolChoiceError(f"tool_choice names {name!r}, which is not in tools")


def max_calls_per_turn(parallel: bool, name: str | None) -> int:
    """The most tool calls one turn may make: one when parallel calls are off or `tool_choice` names a function."""
    return MAX_TOOL_CALLS_PER_TURN if parallel and name is None else 1


class ToolCallParser(ABC):
    """Streaming parser for one choice of one request: splits generated text into content and tool calls.

    A call streams as it is generated: once its head (the function name and the opening of its arguments) is
    complete, a delta with the call's id and name goes out, then one fragment per complete argument (`{"a":1`,
    `,"b":"x"`), then the closing `}` when the call closes and its whole body parses. Every fragment is compact
    JSON, so the fragments of a call always join into its final arguments. A body that turns out malformed, or
    that generation cuts off, is not a call: its text is content, and in the stream its call never receives the
    closing fragment (its arguments stay incomplete JSON, so no client can take it for a complete call). The
    outcome depends only on the text, never on how it was split. Whitespace that only separates content from
    calls is dropped.

    A call with the same name and arguments as an earlier call of the turn ends the turn (`turn_over`): it is
    dropped, and so is everything after it. While a call could still be such a repeat (its name and every
    argument so far agree with an earlier call) its deltas are held back, so a repeat never goes out; a held
    call goes out, in one fragment so far, as soon as it differs from every earlier call, else when it closes.
    """

    __slots__ = (
        "_after_call",
        "_buffer",
        "_call",
        "_content",
        "_held_ws",
        "_id_prefix",
        "_in_call",
        "_made",
        "_next_index",
        "closed",
        "tool_calls",
        "turn_over",
    )

    def __init__(self, id_prefix: str = "call_") -> None:
        self._id_prefix = id_prefix
        # Text not yet resolved: a possible partial open tag outside a call, the whole body inside one.
        self._buffer = ""
        self._in_call = False
        # The call being streamed, once its head is complete.
        self._call: _StreamingCall | None = None
        # Trailing whitespace of the content so far, emitted only once more content follows.
        self._held_ws = ""
        # True while nothing but whitespace has followed the last complete call.
        self._after_call = False
        self._content: list[str] = []
        self.tool_calls: list[ToolCall] = []
        # The stream index of the next call: a call that went out and then failed keeps its index.
        self._next_index = 0
        # (name, arguments as key -> compact JSON value) of each call made, to recognise a repeat.
        self._made: list[tuple[str, dict[str, str]]] = []
        # Close tags that ended a call body, well-formed or not (the per-turn limit counts them).
        self.closed = 0
        self.turn_over = False

    @property
    def content(self) -> str:
        """All content text emitted so far."""
        return "".join(self._content)

    def feed(self, text: str) -> ParserEvents:
        """Take the next piece of generated text; return what can be streamed now."""
        events = ParserEvents()
        if self.turn_over:
            return events
        self._buffer += text
        while self._step(events):
            pass
        return events

    def finish(self, truncated: bool) -> ParserEvents:
        """End of generation: an unterminated call is content, truncated by max_tokens or not."""
        events = ParserEvents()
        if self.turn_over:
            return events
        if self._in_call:
            self._in_call = False
            self._stream(self._buffer, events)
            self._call = None
            self._buffer = OPEN_TAG + self._buffer
        self._text(self._buffer, events)
        self._buffer = ""
        if not self._after_call:
            self._emit(self._held_ws, events)
        self._held_ws = ""
        return events

    @abstractmethod
    def _parse_body(self, body: str) -> tuple[str, dict[str, Any]] | None:
        """The (name, arguments) of the text between the tags, or None when it is not a well-formed call."""

    @abstractmethod
    def _head(self, body: str) -> tuple[str, int] | None:
        """(function name, position after the opening of the arguments) once the body's head is complete."""

    @abstractmethod
    def _member(self, body: str, position: int) -> tuple[str, Any, int] | None:
        """(name, value, end) of the next complete argument at `position`, or None when none is complete yet."""

    def _step(self, events: ParserEvents) -> bool:
        # One transition of the scanner; False when the buffer needs more text to go on.
        if self._in_call:
            end = self._buffer.find(CLOSE_TAG)
            if end < 0:
                self._stream(self._buffer, events)
                return False
            body = self._buffer[:end]
            self._buffer = self._buffer[end + len(CLOSE_TAG) :]
            self._in_call = False
            self.closed += 1
            parsed = self._parse_body(body)
            self._stream(body, events)
            call, self._call = self._call, None
            if call is None:
                self._close_call(body, parsed, events)
            elif not self._close_streamed_call(call, parsed, events):
                self._text(OPEN_TAG + body + CLOSE_TAG, events)
            if self.turn_over:
                self._buffer = ""
            return not self.turn_over
        start = self._buffer.find(OPEN_TAG)
        if start < 0:
            keep = partial_tag_length(self._buffer, OPEN_TAG)
            self._text(self._buffer[: len(self._buffer) - keep], events)
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return False
        self._text(self._buffer[:start], events)
        self._buffer = self._buffer[start + len(OPEN_TAG) :]
        self._in_call = True
        return True

    def _stream(self, body: str, events: ParserEvents) -> None:
        """Send the head of the call in `body` once it is complete, then each argument that is complete."""
        call = self._call
        if call is None:
            head = self._head(body)
            if head is None:
                return
            name, position = head
            call = self._call = _StreamingCall(f"{self._id_prefix}{uuid4().hex[:24]}", name, position)
            call.alike = [members for made, members in self._made if made == name]
            if not call.alike:
                self._send_head(call, events)
        while (member := self._member(body, call.position)) is not None:
            key, value, call.position = member
            fragment = ("," if call.arguments else "{") + _dump_member(key, value)
            call.arguments += fragment
            if call.index is not None:
                events.tool_deltas.append(ToolCallDelta(call.index, None, None, fragment))
                continue
            value_json = _dump(value)
            call.alike = [members for members in call.alike if members.get(key) == value_json]
            if not call.alike:
                self._send_head(call, events)

    def _send_head(self, call: _StreamingCall, events: ParserEvents) -> None:
        """Send a held call's id and name, then the argument fragments held so far as one."""
        call.index = self._next_index
        self._next_index += 1
        events.tool_deltas.append(ToolCallDelta(call.index, call.id, call.name, ""))
        if call.arguments:
            events.tool_deltas.append(ToolCallDelta(call.index, None, None, call.arguments))

    def _close_streamed_call(self, call: _StreamingCall, parsed: tuple[str, dict[str, Any]] | None,
                             events: ParserEvents) -> bool:
        """Send the rest of a streamed call whose body is complete; False when the body does not parse as that
        call (then it is content, and a call that went out stays unterminated)."""
        if parsed is None or parsed[0] != call.name:
            return False
        if call.index is None:
            # Held to the end: it agreed with an earlier call all along.
            if self._repeats(call.name, parsed[1]):
                return True
            self._send_head(call, events)
        complete = _dump(parsed[1])
        # Arguments written twice parse to the last value: the fragments sent stand, closed as they are.
        rest = complete[len(call.arguments):] if complete.startswith(call.arguments) else "}"
        events.tool_deltas.append(ToolCallDelta(call.index, None, None, rest))
        self._made_call(ToolCall(call.id, call.name, call.arguments + rest), parsed[1])
        return True

    def _close_call(self, body: str, parsed: tuple[str, dict[str, Any]] | None, events: ParserEvents) -> None:
        # A body without a head the scanner recognises: a call only when it parses (arguments as a JSON string,
        # or "arguments" before "name").
        if parsed is None:
            self._text(OPEN_TAG + body + CLOSE_TAG, events)
            return
        name, arguments = parsed
        if self._repeats(name, arguments):
            return
        call = ToolCall(f"{self._id_prefix}{uuid4().hex[:24]}", name, _dump(arguments))
        events.tool_deltas.append(ToolCallDelta(self._next_index, call.id, call.name, call.arguments))
        self._next_index += 1
        self._made_call(call, arguments)

    def _repeats(self, name: str, arguments: dict[str, Any]) -> bool:
        """True, and the turn is over, when an earlier call of the turn had this name and these arguments."""
        if (name, _members(arguments)) in self._made:
            self.turn_over = True
        return self.turn_over

    def _made_call(self, call: ToolCall, arguments: dict[str, Any]) -> None:
        self.tool_calls.append(call)
        self._made.append((call.name, _members(arguments)))
        self._after_call = True

    def _text(self, text: str, events: ParserEvents) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
            # The whitespace before the calls separates this text from earlier content, if there is any.
            if not self._content:
                self._held_ws = ""
        body = text.rstrip()
        if not body:
            self._held_ws += text
            return
        self._emit(self._held_ws + body, events)
        self._held_ws = text[len(body) :]

    def _emit(self, text: str, events: ParserEvents) -> None:
        if text:
            events.content += text
            self._content.append(text)


@dataclass(slots=True)
class _StreamingCall:
    """A call whose head is complete: its id and name, its stream index once it went out (None while held), the
    argument fragments so far, where the next argument starts, and the earlier calls it could still repeat."""

    id: str
    name: str
    position: int
    index: int | None = None
    arguments: str = ""
    alike: list[dict[str, str]] = field(default_factory=list)


_JSON_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\\n]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*\{')
_JSON = json.JSONDecoder(parse_constant=lambda name: _reject_constant(name))
_WHITESPACE = re.compile(r"\s*")


class QwenJsonToolParser(ToolCallParser):
    """Qwen3 / Hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`."""

    __slots__ = ()

    def _parse_body(self, body: str) -> tuple[str, dict[str, Any]] | None:
        call = _loads(body)
        if (
            not isinstance(call, dict)
            or not isinstance(call.get("name"), str)
            or not call["name"]
        ):
            return None
        arguments = call.get("arguments", call.get("parameters"))
        if arguments is None:
            return call["name"], {}
        if isinstance(arguments, str):
            arguments = _loads(arguments)
        return (call["name"], arguments) if isinstance(arguments, dict) else None

    def _head(self, body: str) -> tuple[str, int] | None:
        head = _JSON_HEAD.match(body)
        if head is None:
            return None
        name = _loads(head[1])
        return (name, head.end()) if isinstance(name, str) and name else None

    def _member(self, body: str, position: int) -> tuple[str, Any, int] | None:
        position = _WHITESPACE.match(body, position).end()
        if body.startswith(",", position):
            position = _WHITESPACE.match(body, position + 1).end()
        try:
            key, position = _JSON.raw_decode(body, position)
            position = _WHITESPACE.match(body, position).end()
            if not body.startswith(":", position):
                return None
            value, position = _JSON.raw_decode(body, _WHITESPACE.match(body, position + 1).end())
        except (ValueError, RecursionError):
            return None
        # A value counts once what follows shows it ended: a number at the end of the text may go on.
        after = _WHITESPACE.match(body, position).end()
        if not isinstance(key, str) or after >= len(body) or body[after] not in ",}":
            return None
        return key, value, after


_FUNCTION_HEAD = re.compile(r"\s*<function=([^>\n]+)>")
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


class QwenXmlToolParser(ToolCallParser):
    """Qwen3.5 / Qwen3-Coder: `<function=NAME>` with `<parameter=P>` values typed by the request's schemas."""

    __slots__ = ("_schemas",)

    def __init__(self, tools: list[dict] | None, id_prefix: str = "call_") -> None:
        super().__init__(id_prefix)
        self._schemas = _parameter_schemas(tools)

    def _parse_body(self, body: str) -> tuple[str, dict[str, Any]] | None:
        function = _FUNCTION.fullmatch(body)
        if function is None or not function[1].strip():
            return None
        name, inner = function[1].strip(), function[2]
        arguments: dict[str, Any] = {}
        position = 0
        while (member := self._parameter(name, inner, position)) is not None:
            key, value, position = member
            arguments[key] = value
        if inner[position:].strip():
            return None
        return name, arguments

    def _head(self, body: str) -> tuple[str, int] | None:
        head = _FUNCTION_HEAD.match(body)
        if head is None or not head[1].strip():
            return None
        return head[1].strip(), head.end()

    def _member(self, body: str, position: int) -> tuple[str, Any, int] | None:
        return self._parameter(self._call.name, body, position)

    def _parameter(self, function: str, text: str, position: int) -> tuple[str, Any, int] | None:
        parameter = _PARAMETER.match(text, position)
        if parameter is None:
            return None
        # The template writes each value between newlines; any further newlines belong to the value.
        value = parameter[2].removeprefix("\n").removesuffix("\n")
        key = parameter[1].strip()
        return key, _coerce(value, self._schemas.get(function, {}).get(key)), parameter.end()


def make_tool_parser(
    dialect: str, tools: list[dict] | None, id_prefix: str = "call_"
) -> ToolCallParser:
    """A fresh parser for one choice of one request."""
    if dialect == QWEN_JSON:
        return QwenJsonToolParser(id_prefix)
    if dialect == QWEN_XML:
        return QwenXmlToolParser(tools, id_prefix)
    raise ValueError(f"unknown tool-call dialect {dialect!r}")


def _dump(value: Any) -> str:
    """Compact JSON, as every argument fragment is written."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _dump_member(key: str, value: Any) -> str:
    """`"key":value` as it appears inside `_dump` of an object holding it."""
    return _dump({key: value})[1:-1]


def _members(arguments: dict[str, Any]) -> dict[str, str]:
    """Arguments as key -> compact JSON of the value: equal for the same arguments in any order, and unequal for
    values Python equates but JSON does not (1, 1.0, true)."""
    return {key: _dump(value) for key, value in arguments.items()}


def _reject_constant(name: str) -> None:
    # NaN and Infinity are not JSON: re-serialised, they would make the arguments string invalid.
    raise ValueError(f"{name} is not JSON")


def _loads(text: str) -> Any:
    # None for anything that is not strict JSON; generated text must never raise.
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None


def _parameter_schemas(tools: list[dict] | None) -> dict[str, dict[str, Any]]:
    # function name -> its parameters' JSON-schema "properties"
    schemas: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        parameters = function.get("parameters")
        properties = (
            parameters.get("properties") if isinstance(parameters, dict) else None
        )
        schemas[function["name"]] = properties if isinstance(properties, dict) else {}
    return schemas


_INTEGER = re.compile(r"-?\d+")
_NUMBER = re.compile(r"-?\d+(\.\d+)?([eE][+-]?\d+)?")
_NOT = object()


def _as_null(text: str) -> Any:
    return None if text == "null" else _NOT


def _as_boolean(text: str) -> Any:
    return {"true": True, "false": False}.get(text.lower(), _NOT)


def _as_integer(text: str) -> Any:
    if not _INTEGER.fullmatch(text):
        return _NOT
    try:
        return int(text)
    except ValueError:  # past Python's int-from-string digit limit
        return _NOT


def _as_number(text: str) -> Any:
    if _INTEGER.fullmatch(text):
        return _as_integer(text)
    if not _NUMBER.fullmatch(text):
        return _NOT
    number = float(text)
    return number if math.isfinite(number) else _NOT


def _as_object(text: str) -> Any:
    value = _loads(text)
    return value if isinstance(value, dict) else _NOT


def _as_array(text: str) -> Any:
    value = _loads(text)
    return value if isinstance(value, list) else _NOT


# Tried in this order whatever order a type list declares, so "null" and "5" read as null and 5
# under ["string", "null"] or ["string", "integer"]; a value no declared type accepts stays a string.
_COERCIONS = (
    ("null", _as_null),
    ("boolean", _as_boolean),
    ("integer", _as_integer),
    ("number", _as_number),
    ("object", _as_object),
    ("array", _as_array),
)


def _coerce(value: str, schema: Any) -> Any:
    declared = schema.get("type") if isinstance(schema, dict) else None
    types = declared if isinstance(declared, list) else [declared]
    text = value.strip()
    for kind, convert in _COERCIONS:
        if kind in types:
            converted = convert(text)
            if converted is not _NOT:
                return converted
    return value
