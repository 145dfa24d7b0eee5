"""OpenAI's Responses API on the chat driver: a Responses request becomes a chat request, and the chat events become
output items (reasoning, message, function calls), written as a `response` object or as its stream of typed events.

Both forms run the same `ResponseBuilder` over the same events, so they always agree. A stored response keeps the
conversation it ends as chat messages; `previous_response_id` puts them before the new input, so the new prompt
starts with the earlier one and the engine serves that part from its cache.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from basert.server.access_log import RequestRecord
from basert.server.catalog import ServedModel
from basert.server.chat_api import ChatRun, ChoiceDelta, ChoiceEnd, start_chat
from basert.server.errors import ApiError, invalid, to_api_error
from basert.server.generation import ServerLimits
from basert.server.response_store import ResponseStore
from basert.server.responses_schemas import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionToolSpec,
    InputItem,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    TextFormat,
    TextPart,
)
from basert.server.schemas import ChatCompletionRequest
from basert.server.state import server_state

# --- request: Responses input as chat messages --------------------------------------------------


def part_text(content: str | list[TextPart]) -> str:
    """A message's text: its parts joined by newlines, as a chat template sees a list of parts."""
    return content if isinstance(content, str) else "\n".join(part.text for part in content)


def open_assistant(messages: list[dict]) -> dict | None:
    """The final message when it is an assistant turn that its next output item may extend, else None."""
    if messages and messages[-1]["role"] == "assistant":
        return messages[-1]
    return None


def add_item(messages: list[dict], item: InputItem) -> None:
    """Append one input item to a chat conversation.

    One assistant turn arrives as several items (reasoning, message, function calls): they become one assistant
    message, as /v1/chat/completions returns it.
    """
    last = open_assistant(messages)
    if isinstance(item, ReasoningItem):
        text = "\n".join(part.text for part in item.content or ())
        messages.append({"role": "assistant", "content": None, "reasoning_content": text})
    elif isinstance(item, MessageItem):
        if item.role == "assistant" and last is not None and last["content"] is None and "tool_calls" not in last:
            last["content"] = part_text(item.content)
        else:
            messages.append({"role": item.role, "content": part_text(item.content)})
    elif isinstance(item, FunctionCallItem):
        if last is None:
            last = {"role": "assistant", "content": None}
            messages.append(last)
        call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
        last.setdefault("tool_calls", []).append(call)
    elif isinstance(item, FunctionCallOutputItem):
        messages.append({"role": "tool", "tool_call_id": item.call_id, "content": part_text(item.output)})


def input_messages(value: str | list[InputItem]) -> list[dict]:
    """The request's `input` as chat messages: a string is one user message."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict] = []
    for item in value:
        add_item(messages, item)
    return messages


def chat_tools(tools: list[FunctionToolSpec] | None) -> list[dict] | None:
    """Responses function tools in the chat form (`{"type": "function", "function": {...}}`)."""
    if not tools:
        return None
    return [{"type": "function", "function": tool.model_dump(include={"name", "description", "parameters"},
                                                             exclude_none=True)} for tool in tools]


def chat_response_format(text_format: TextFormat) -> dict | None:
    """`text.format` as a chat `response_format`."""
    if text_format.type == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": text_format.name, "schema": text_format.schema_,
                                                       "strict": text_format.strict}}
    return {"type": text_format.type}


def template_kwargs(body: ResponsesRequest) -> dict | None:
    """`reasoning.effort` as the template's `enable_thinking`: "none" turns thinking off, any other effort on."""
    if body.reasoning is None or body.reasoning.effort is None:
        return None
    return {"enable_thinking": body.reasoning.effort != "none"}


def chat_request(body: ResponsesRequest, conversation: list[dict]) -> ChatCompletionRequest:
    """The chat request for `conversation`, with the instructions as its first (system) message.

    A final assistant message opens a new turn, as in OpenAI's API, rather than being continued.
    """
    instructions = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if not conversation:
        raise invalid("input is required (or previous_response_id)", "input")
    tool_choice = body.tool_choice
    if not isinstance(tool_choice, str):
        tool_choice = {"type": "function", "function": {"name": tool_choice.name}}
    return ChatCompletionRequest.model_validate({
        "model": body.model,
        "messages": instructions + conversation,
        "tools": chat_tools(body.tools),
        "tool_choice": tool_choice,
        "parallel_tool_calls": body.parallel_tool_calls,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "response_format": chat_response_format(body.text.format),
        "chat_template_kwargs": template_kwargs(body),
        "continue_final_message": False,
    })


# --- output: chat events as output items ------------------------------------------------------


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class OpenItem:
    """The output item receiving text now: its position, its fields (content left out), its text so far."""

    index: int
    item: dict
    text: str = ""

    @property
    def kind(self) -> str:
        return self.item["type"]


@dataclass(slots=True)
class OutputItems:
    """One choice's chat events as output items, in the order the model wrote them; each method returns the
    stream events (without sequence numbers) its change makes."""

    done: list[dict] = field(default_factory=list)
    open: OpenItem | None = None
    reasoning_tokens: int = 0        # tokens whose text went to reasoning

    def feed(self, delta: ChoiceDelta) -> list[dict]:
        """The events of one chat delta: reasoning text, then content text, then tool-call pieces."""
        events = []
        if delta.reasoning:
            self.reasoning_tokens += 1
            events += self._text("reasoning", delta.reasoning)
        if delta.content:
            events += self._text("message", delta.content)
        for piece in delta.tool_calls:
            if piece.id is not None:
                events += self.close("completed")
                events += self._start({"type": "function_call", "id": item_id("fc"), "call_id": piece.id,
                                       "name": piece.name, "arguments": ""})
            elif self.open is None or self.open.kind != "function_call":
                raise RuntimeError("a tool-call piece arrived before the first piece of its call")
            if piece.arguments:
                events.append(self._delta(piece.arguments))
        return events

    def _text(self, kind: str, text: str) -> list[dict]:
        events = []
        if self.open is None or self.open.kind != kind:
            events += self.close("completed")
            if kind == "reasoning":
                events += self._start({"type": "reasoning", "id": item_id("rs"), "summary": []})
            else:
                events += self._start({"type": "message", "id": item_id("msg"), "role": "assistant"})
        events.append(self._delta(text))
        return events

    def _start(self, fields: dict) -> list[dict]:
        index = len(self.done)
        self.open = OpenItem(index, {**fields, "status": "in_progress"})
        if fields["type"] == "function_call":
            return [{"type": "response.output_item.added", "output_index": index, "item": self.open.item}]
        added = {**self.open.item, "content": []}
        return [{"type": "response.output_item.added", "output_index": index, "item": added},
                {"type": "response.content_part.added", "item_id": fields["id"], "output_index": index,
                 "content_index": 0, "part": empty_part(fields["type"])}]

    def _delta(self, text: str) -> dict:
        assert self.open is not None
        self.open.text += text
        where = {"item_id": self.open.item["id"], "output_index": self.open.index}
        if self.open.kind == "function_call":
            return {"type": "response.function_call_arguments.delta", **where, "delta": text}
        if self.open.kind == "reasoning":
            return {"type": "response.reasoning_text.delta", **where, "content_index": 0, "delta": text}
        return {"type": "response.output_text.delta", **where, "content_index": 0, "delta": text, "logprobs": []}

    def close(self, status: str) -> list[dict]:
        """The events that end the open item, if any, with `status` ("completed" or "incomplete")."""
        current, self.open = self.open, None
        if current is None:
            return []
        where = {"item_id": current.item["id"], "output_index": current.index}
        if current.kind == "function_call":
            item = {**current.item, "arguments": current.text, "status": "completed"}
            events = [{"type": "response.function_call_arguments.done", **where, "name": item["name"],
                       "arguments": current.text}]
        else:
            part = {**empty_part(current.kind), "text": current.text}
            item = {**current.item, "content": [part], "status": status}
            text_done = ({"type": "response.reasoning_text.done", **where, "content_index": 0, "text": current.text}
                         if current.kind == "reasoning" else
                         {"type": "response.output_text.done", **where, "content_index": 0, "text": current.text,
                          "logprobs": []})
            events = [text_done, {"type": "response.content_part.done", **where, "content_index": 0, "part": part}]
        self.done.append(item)
        return [*events, {"type": "response.output_item.done", "output_index": current.index, "item": item}]


def empty_part(kind: str) -> dict:
    """The content part an item of `kind` ("reasoning" or "message") holds, before any text."""
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": ""}
    return {"type": "output_text", "text": "", "annotations": []}


class ResponseBuilder:
    """A `response` object growing from one chat run's events: lifecycle snapshots, output items, the final object."""

    def __init__(self, body: ResponsesRequest, run: ChatRun):
        self.body = body
        self.run = run
        # The same hex as the run's id ("resp-…", which names its engine requests in the logs), in OpenAI's form.
        self.id = "resp_" + run.response_id.partition("-")[2]
        self.items = OutputItems()
        self.end: ChoiceEnd | None = None

    def take(self, event: ChoiceDelta | ChoiceEnd) -> list[dict]:
        """The stream events one chat event makes."""
        if isinstance(event, ChoiceEnd):
            self.end = event
            return self.items.close("incomplete" if event.finish_reason == "length" else "completed")
        return self.items.feed(event)

    def snapshot(self, status: str) -> dict:
        """The response object as it stands, with `status` (the form of the lifecycle events)."""
        body = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.run.created, "status": status,
            "background": False, "error": None, "incomplete_details": None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {}, "model": self.run.model.info.id, "output": list(self.items.done),
            "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
            "store": body.store, "temperature": body.temperature,
            "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)},
            "tool_choice": body.tool_choice if isinstance(body.tool_choice, str) else body.tool_choice.model_dump(),
            "tools": [tool.model_dump(include={"type", "name", "description", "parameters", "strict"})
                      for tool in body.tools or ()],
            "top_p": body.top_p, "truncation": "disabled", "usage": None, "user": body.user,
        }

    def final(self) -> dict:
        """The finished response: "incomplete" when the token budget (or the request timeout) ended it."""
        assert self.end is not None
        response = self.snapshot("completed")
        if self.end.finish_reason == "length":
            response["status"] = "incomplete"
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        response["completed_at"] = int(time.time())
        response["usage"] = self.usage()
        response["timings"] = self.run.timings()
        return response

    def failed(self, error: ApiError) -> dict:
        """The response after a failure mid-stream."""
        response = self.snapshot("failed")
        response["error"] = {"code": error_code(error), "message": error.message, "param": error.param}
        return response

    def usage(self) -> dict:
        """OpenAI's usage object; the prompt tokens not served from the cache are the ones written to it (the slot
        keeps them for the next request)."""
        chat = self.run.usage()
        cached = chat["prompt_tokens_details"]["cached_tokens"]
        return {
            "input_tokens": chat["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": chat["prompt_tokens"] - cached},
            "output_tokens": chat["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": self.items.reasoning_tokens},
            "total_tokens": chat["total_tokens"],
        }


# --- the endpoint -------------------------------------------------------------------------------


@dataclass(slots=True)
class Conversation:
    """A request's conversation without its instructions, and where the response will be kept (None: not kept)."""

    messages: list[dict]
    store: ResponseStore | None

    def keep(self, response: dict, end: ChoiceEnd) -> None:
        """Store `response` with the conversation it ends (its answer as the chat assistant message)."""
        if self.store is not None:
            self.store.put(response, [*self.messages, end.state.message()])


async def create_response(model: ServedModel, body: ResponsesRequest, limits: ServerLimits, record: RequestRecord):
    """A `response` object, or an async iterator of its SSE events when streaming."""
    store = server_state().responses
    history = store.get(body.previous_response_id, "previous_response_id").messages if body.previous_response_id \
        else []
    conversation = Conversation([*history, *input_messages(body.input)], store if body.store else None)
    run = await start_chat(model, chat_request(body, conversation.messages), limits, record, id_prefix="resp")
    builder = ResponseBuilder(body, run)
    if body.stream:
        return stream_response(builder, conversation)
    async with aclosing(run.events()) as events:
        async for event in events:
            builder.take(event)
    response = builder.final()
    conversation.keep(response, builder.end)
    return response


def error_code(error: ApiError) -> str:
    """The code a failed response reports: "server_error" for a server fault, else the error's own code."""
    return "server_error" if error.status >= 500 or error.code is None else str(error.code)


def sse_event(event: dict, sequence_number: int) -> bytes:
    """One typed server-sent event: its type as the SSE event name, the event (with its number) as data."""
    payload = json.dumps({**event, "sequence_number": sequence_number}, ensure_ascii=False)
    return f"event: {event['type']}\ndata: {payload}\n\n".encode()


async def stream_response(builder: ResponseBuilder, conversation: Conversation) -> AsyncIterator[bytes]:
    """response.created and .in_progress, the output items' events, then response.completed (or .incomplete).
    A failure after the first byte is an `error` event, then response.failed."""
    sequence = 0

    def event(payload: dict) -> bytes:
        nonlocal sequence
        sequence += 1
        return sse_event(payload, sequence - 1)

    yield event({"type": "response.created", "response": builder.snapshot("in_progress")})
    yield event({"type": "response.in_progress", "response": builder.snapshot("in_progress")})
    try:
        async with aclosing(builder.run.events()) as events:
            async for chat_event in events:
                for payload in builder.take(chat_event):
                    yield event(payload)
        response = builder.final()
        conversation.keep(response, builder.end)
        yield event({"type": f"response.{response['status']}", "response": response})
    except Exception as exc:  # after the first byte: the error as events
        error = to_api_error(exc)
        yield event({"type": "error", "code": error_code(error), "message": error.message, "param": error.param})
        yield event({"type": "response.failed", "response": builder.failed(error)})
