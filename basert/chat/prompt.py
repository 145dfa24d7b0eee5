"""Renders a conversation (with its tools) through the model's chat template into prompt tokens.

The server's chat APIs and `basert.Model.chat` both plan their prompts here, so a conversation becomes the same
tokens whichever way it arrives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from basert.chat.encoder import ChatEncoder
from basert.chat.reasoning import opens_in_prompt
from basert.chat.template import ChatTemplate, content_text
from basert.chat.tool_calls import inject_tool_prompt
from basert.tokenizer import Tokenizer, common_prefix


@dataclass(slots=True)
class ChatPlan:
    """A rendered conversation: its tokens, the tools its output may call, and how its output starts."""

    prompt: list[int]
    tools: list[dict] | None
    starts_in_reasoning: bool
    has_reasoning: bool
    segment_ends: tuple[int, ...] = ()


def plan_chat_prompt(template: ChatTemplate, tokenizer: Tokenizer, messages: list[dict], tools: list[dict] | None,
                     *, may_call: bool = True, template_kwargs: dict[str, Any] | None = None,
                     constrained: bool = False, continue_final: bool = False, add_generation_prompt: bool = True,
                     segment_ends: bool = False) -> ChatPlan:
    """Render OpenAI-shaped `messages` and the request's `tools` (None: no tools) and tokenize them.

    `may_call`: the output may call the tools (false for `tool_choice` "none": the tools are rendered all the same,
    so the prompt, and the prefix cache it hits, is the one a turn that may call them has).
    `constrained`: a grammar will shape the output, so thinking is off unless `template_kwargs` says otherwise.
    `continue_final`: the prompt continues the final message (a prefill) rather than opening a new turn.
    `segment_ends`: say where the system prompt and the previous turn end (hybrid models keep their state there).
    Special-token text inside messages and tools stays plain text: only the template's markup becomes control tokens.
    """
    kwargs = dict(template_kwargs or {})
    if constrained:
        # A grammar forces the answer to start at once: a reasoning block opened by the prompt would
        # swallow it, so thinking is off unless the request asks otherwise.
        kwargs.setdefault("enable_thinking", False)
    template_tools = tools
    if tools and not template.supports_tools:
        messages = inject_tool_prompt(messages, tools)
        template_tools = None
    encoder = ChatEncoder(tokenizer)
    messages = encoder.hide(messages)
    template_tools = encoder.hide(template_tools)
    if continue_final:
        rendered = render_prefill(template, messages, template_tools, kwargs)
    else:
        rendered = template.render(messages, tools=template_tools, add_generation_prompt=add_generation_prompt,
                                   **kwargs)
    prompt = encoder.encode(rendered)
    has_reasoning = "<think>" in (tokenizer.chat_template or "") or "<think>" in rendered
    ends = message_boundaries(encoder, messages, rendered, prompt) if segment_ends else ()
    return ChatPlan(prompt, tools if may_call else None, opens_in_prompt(rendered), has_reasoning, ends)


def render_prefill(template: ChatTemplate, messages: list[dict], tools: list[dict] | None, kwargs: dict) -> str:
    """The prompt that continues the final message: the conversation rendered with it, cut right after its text
    (the template's end-of-turn markup dropped), the text looked for after the turns before it only (it may also
    occur in them); where the template changes that text (trims it, say), the conversation before it with a
    generation prompt, then the text."""
    text = content_text(messages[-1].get("content"))
    opened = template.render(messages[:-1], tools=tools, add_generation_prompt=True, **kwargs)
    if text:
        closed = template.render(messages, tools=tools, add_generation_prompt=False, **kwargs)
        at = closed.find(text, len(opened)) if closed.startswith(opened) else -1
        if at >= 0:
            return closed[: at + len(text)]
    return opened + text


def message_boundaries(encoder: ChatEncoder, messages: list[dict], rendered: str, prompt: list[int]) -> tuple[int, ...]:
    """Token positions where the first message (the system prompt) and the previous turn end.

    A hybrid model keeps its recurrent state there, so the next request that shares the system prompt or
    the conversation so far resumes from it. Found by locating each message's text in the rendered prompt
    (rendering a partial conversation is not possible with every template). `messages` and `rendered` are
    what the template saw, markers included.
    """
    ends = set()
    cursor = 0
    wanted = {0, len(messages) - 2}
    for index, message in enumerate(messages[:-1]):
        content = message.get("content")
        if not isinstance(content, str) or not content:
            continue
        at = rendered.find(content, cursor)
        if at < 0:
            break
        cursor = at + len(content)
        if index in wanted:
            ends.add(common_prefix(encoder.encode(rendered[:cursor]), prompt))
    return tuple(sorted(end for end in ends if end > 0))
