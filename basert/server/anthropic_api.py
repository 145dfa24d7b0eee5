"""Anthropic's Messages API on the chat driver: a request becomes a `ChatCompletionRequest`, and the driver's events
become content blocks (thinking, text, tool_use), a `message` object or its stream events, in Anthropic's shapes.

Mapping choices: thinking blocks sent back in assistant turns become the turn's `reasoning_content` (the template
decides whether to render it; redacted thinking is dropped); a tool_result with `is_error` reaches the model as
"Error: " before its text; tool_use ids in the history pass through unchanged as tool-call ids, and a call the model
makes is reported with its id's `call_` prefix replaced by `toolu_`. Thinking blocks carry an empty signature.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing

from basert.chat.tool_calls import ToolCallDelta
from basert.server.access_log import RequestRecord
from basert.server.anthropic_schemas import (
    ContentBlock,
    InputMessage,
    MessagesInput,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolChoice,
    ToolDefinition,
    ToolResultBlock,
    ToolUseBlock,
)
from basert.server.catalog import ServedModel
from basert.server.chat_api import ChatRun, ChoiceDelta, ChoiceEnd, plan_chat, start_chat
from basert.server.errors import to_api_error
from basert.server.generation import ServerLimits
from basert.server.schemas import (
    ChatCompletionRequest,
    FunctionDefinition,
    Message,
    NamedToolChoice,
    NamedToolChoiceFunction,
    TextPart,
    Tool,
)

# --- request: Anthropic messages to a chat request ------------------------------------------------


def chat_request(body: MessagesInput, **sampling) -> ChatCompletionRequest:
    """The chat request that renders the same prompt as `body`; `sampling` adds the generation fields."""
    choice = body.tool_choice
    return ChatCompletionRequest(
        model=body.model,
        messages=chat_messages(body),
        tools=[openai_tool(tool) for tool in body.tools] if body.tools else None,
        tool_choice=openai_tool_choice(choice) if choice is not None else None,
        parallel_tool_calls=not (choice is not None and choice.disable_parallel_tool_use),
        chat_template_kwargs={"enable_thinking": body.thinking.enabled} if body.thinking is not None else None,
        **sampling,
    )


def generation_request(body: MessagesRequest) -> ChatCompletionRequest:
    """The chat request of a /v1/messages body, sampling fields included."""
    return chat_request(body, max_tokens=body.max_tokens, stop=body.stop_sequences, temperature=body.temperature,
                        top_p=body.top_p, top_k=body.top_k, stream=body.stream)


def chat_messages(body: MessagesInput) -> list[Message]:
    """The system prompt, then each Anthropic message as one or more chat messages."""
    messages = []
    if body.system:
        messages.append(Message(role="system", content=text_parts(body.system)))
    for message in body.messages:
        messages += turn_messages(message)
    return messages


def text_parts(content: str | list[TextBlock]) -> str | list[TextPart]:
    return content if isinstance(content, str) else [TextPart(type="text", text=block.text) for block in content]


def turn_messages(message: InputMessage) -> list[Message]:
    if isinstance(message.content, str):
        return [Message(role=message.role, content=message.content)]
    if message.role == "assistant":
        return [assistant_turn(message.content)]
    return user_turn(message.content)


def user_turn(blocks: list[ContentBlock]) -> list[Message]:
    """A user turn: one tool message per tool_result, runs of text blocks as user messages, in their order."""
    messages: list[Message] = []
    for block in blocks:
        if isinstance(block, ToolResultBlock):
            messages.append(Message(role="tool", tool_call_id=block.tool_use_id, content=tool_result_text(block)))
        elif messages and messages[-1].role == "user":
            messages[-1].content.append(TextPart(type="text", text=block.text))
        else:
            messages.append(Message(role="user", content=[TextPart(type="text", text=block.text)]))
    return messages


def tool_result_text(block: ToolResultBlock) -> str:
    content = block.content
    text = content if isinstance(content, str) else "\n".join(part.text for part in content)
    return f"Error: {text}" if block.is_error else text


def assistant_turn(blocks: list[ContentBlock]) -> Message:
    """An assistant turn: its text, its thinking as reasoning_content, its tool_use blocks as tool calls."""
    texts = [TextPart(type="text", text=block.text) for block in blocks if isinstance(block, TextBlock)]
    thinking = "\n".join(block.thinking for block in blocks if isinstance(block, ThinkingBlock))
    calls = [{"id": block.id, "type": "function",
              "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}}
             for block in blocks if isinstance(block, ToolUseBlock)]
    return Message(role="assistant", content=texts or None, tool_calls=calls or None,
                   reasoning_content=thinking or None)


def openai_tool(tool: ToolDefinition) -> Tool:
    return Tool(function=FunctionDefinition(name=tool.name, description=tool.description,
                                            parameters=tool.input_schema))


def openai_tool_choice(choice: ToolChoice) -> str | NamedToolChoice:
    """auto and none as they are, any as required, a named tool as a named function."""
    if choice.type == "tool":
        return NamedToolChoice(function=NamedToolChoiceFunction(name=choice.name))
    return "required" if choice.type == "any" else choice.type


# --- response: chat events to content blocks -----------------------------------------------------


# How a thinking or text block starts; thinking blocks carry an empty signature (nothing here signs them).
EMPTY_TEXT_BLOCKS = {"thinking": {"type": "thinking", "thinking": "", "signature": ""},
                     "text": {"type": "text", "text": ""}}


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


class ContentBlocks:
    """The content blocks of one answer, built from its deltas; `feed` and `close` also return the stream events
    that build them, so a streamed answer and a complete one are the same blocks.

    A block opens when the kind of output changes (thinking, text) or a tool call starts, and closes when the
    next one opens. A call's argument fragments belong to the call opened last (calls are parsed one at a time).
    """

    def __init__(self) -> None:
        self.blocks: list[dict] = []
        self._open = False
        self._arguments = ""

    def feed(self, delta: ChoiceDelta) -> list[dict]:
        events = []
        if delta.reasoning:
            events += self._text("thinking", delta.reasoning)
        if delta.content:
            events += self._text("text", delta.content)
        for call in delta.tool_calls:
            events += self._tool_call(call)
        return events

    def close(self) -> list[dict]:
        """Close the open block, if any: its stop event."""
        if not self._open:
            return []
        self._open = False
        block = self.blocks[-1]
        if block["type"] == "tool_use":
            block["input"] = json.loads(self._arguments or "{}")
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def _text(self, kind: str, text: str) -> list[dict]:
        events = []
        if not (self._open and self.blocks[-1]["type"] == kind):
            events += self._start(EMPTY_TEXT_BLOCKS[kind])
        self.blocks[-1][kind] += text
        events.append(self._delta({"type": f"{kind}_delta", kind: text}))
        return events

    def _tool_call(self, call: ToolCallDelta) -> list[dict]:
        events = []
        if call.id is not None:
            events += self._start({"type": "tool_use", "id": tool_use_id(call.id), "name": call.name, "input": {}})
            self._arguments = ""
        if call.arguments:
            self._arguments += call.arguments
            events.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
        return events

    def _start(self, block: dict) -> list[dict]:
        events = self.close()
        self.blocks.append(dict(block))
        self._open = True
        return events + [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": block}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}


def stop_reason(end: ChoiceEnd) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for how a choice ended."""
    if end.finish_reason == "tool_calls":
        return "tool_use", None
    if end.finish_reason == "length":
        return "max_tokens", None
    if end.done.stop_word:
        return "stop_sequence", end.done.stop_word
    return "end_turn", None


def usage_body(run: ChatRun) -> dict:
    """Anthropic usage: input_tokens counts the prompt tokens not read from the cache."""
    usage = run.usage()
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": usage["prompt_tokens"] - cached, "output_tokens": usage["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def message_body(run: ChatRun, content: list[dict], end: ChoiceEnd | None, usage: dict) -> dict:
    """A `message` object; without `end`, the opening one of a stream (no stop reason yet)."""
    reason, sequence = stop_reason(end) if end is not None else (None, None)
    return {"id": "msg_" + run.response_id.removeprefix("msg-"), "type": "message", "role": "assistant",
            "model": run.model.info.id, "content": content, "stop_reason": reason,
            "stop_sequence": sequence, "usage": usage}


async def create_message(model: ServedModel, body: MessagesRequest, limits: ServerLimits, record: RequestRecord):
    """A `message` object, or an async iterator of its SSE events when streaming."""
    run = await start_chat(model, generation_request(body), limits, record, id_prefix="msg")
    if body.stream:
        return stream_message(run)
    blocks = ContentBlocks()
    ends = []
    async with aclosing(run.events()) as events:
        async for event in events:
            if isinstance(event, ChoiceDelta):
                blocks.feed(event)
            else:
                blocks.close()
                ends.append(event)
    return message_body(run, blocks.blocks, ends[0], usage_body(run))


def sse_event(data: dict) -> bytes:
    """One server-sent event named by its payload's type, as Anthropic's clients dispatch on the name."""
    return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


async def stream_message(run: ChatRun) -> AsyncIterator[bytes]:
    """message_start, the blocks' start / delta / stop events, message_delta and message_stop; a failure after the
    first byte is an error event."""
    opening_usage = {"input_tokens": len(run.plan.prompt), "output_tokens": 0, "cache_read_input_tokens": 0,
                     "cache_creation_input_tokens": 0}
    blocks = ContentBlocks()
    try:
        yield sse_event({"type": "message_start", "message": message_body(run, [], None, opening_usage)})
        async with aclosing(run.events()) as events:
            async for event in events:
                if isinstance(event, ChoiceDelta):
                    for block_event in blocks.feed(event):
                        yield sse_event(block_event)
                    continue
                for block_event in blocks.close():
                    yield sse_event(block_event)
                reason, sequence = stop_reason(event)
                yield sse_event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                 "usage": usage_body(run)})
        yield sse_event({"type": "message_stop"})
    except Exception as exc:
        error = to_api_error(exc)
        yield sse_event(error_body(error.status, error.message))


def count_tokens(model: ServedModel, body: MessagesInput) -> dict:
    """The token count of the prompt `body` renders."""
    return {"input_tokens": len(plan_chat(model, chat_request(body)).prompt)}


# --- errors -------------------------------------------------------------------------------------

# Anthropic's error type for each HTTP status it documents (ours keep their status: 503 is not turned into 529).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
               504: "timeout_error"}


def error_body(status: int, message: str) -> dict:
    """Anthropic's error envelope for an error of this HTTP status."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
