"""Splits generated text into reasoning (`<think>…</think>`) and content, as it streams.

The server runs this first and feeds its content into the tool-call parser.
"""

from __future__ import annotations

from enum import Enum


class _State(Enum):
    OPENING = "opening"  # nothing but whitespace yet: the output may still open a reasoning block
    REASONING = "reasoning"
    CONTENT = "content"


def opens_in_prompt(
    rendered_prompt: str, start: str = "<think>", end: str = "</think>"
) -> bool:
    """Whether the rendered prompt ends inside an open reasoning block (the template opened it for the model)."""
    return rendered_prompt.rfind(start) > rendered_prompt.rfind(end)


class ReasoningParser:
    """Streaming splitter for one choice of one request.

    Only a reasoning block at the very start of the output counts (after leading whitespace): once content
    has begun, a literal `<think>` is content, and so is anything after the first end tag.
    """

    __slots__ = ("_buffer", "_end", "_start", "_state", "_strip_leading")

    def __init__(
        self,
        start: str = "<think>",
        end: str = "</think>",
        *,
        starts_in_reasoning: bool = False,
    ) -> None:
        self._start = start
        self._end = end
        self._state = _State.REASONING if starts_in_reasoning else _State.OPENING
        # Text held back because it may be the beginning of a tag.
        self._buffer = ""
        # Qwen writes "</think>\n\n" before the answer; that whitespace is not content.
        self._strip_leading = False

    def feed(self, text: str) -> tuple[str, str]:
        """Take the next piece of generated text; return the (reasoning, content) that can be streamed now."""
        self._buffer += text
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self._state is _State.OPENING:
                stripped = self._buffer.lstrip()
                if stripped.startswith(self._start):
                    self._buffer = stripped[len(self._start) :]
                    self._state = _State.REASONING
                elif self._start.startswith(stripped):
                    break
                else:
                    self._state = _State.CONTENT
            elif self._state is _State.REASONING:
                end = self._buffer.find(self._end)
                if end < 0:
                    keep = partial_tag_length(self._buffer, self._end)
                    reasoning.append(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    break
                reasoning.append(self._buffer[:end])
                self._buffer = self._buffer[end + len(self._end) :]
                self._state = _State.CONTENT
                self._strip_leading = True
            else:
                content.append(self._content(self._buffer))
                self._buffer = ""
                break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """End of generation: release held-back text; a stream that ends inside reasoning stays reasoning."""
        held, self._buffer = self._buffer, ""
        if self._state is _State.REASONING:
            return held, ""
        return "", self._content(held)

    def _content(self, text: str) -> str:
        if self._strip_leading:
            text = text.lstrip()
            self._strip_leading = not text
        return text


def partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest end of `text` that could still grow into `tag` (text to hold back)."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0
