"""Splitting `<think>` reasoning from content while streaming, and chaining into the tool-call parser."""

from __future__ import annotations

from pathlib import Path

import pytest

from basert.chat.reasoning import ReasoningParser, opens_in_prompt
from basert.chat.template import ChatTemplate
from basert.chat.tool_calls import QWEN_XML, make_tool_parser

TEMPLATES = Path(__file__).parent / "fixtures" / "chat-templates"
MESSAGES = [{"role": "user", "content": "What is 2+2?"}]

# (starts_in_reasoning, generated text, reasoning, content)
CASES = {
    "think_then_answer": (
        False,
        "<think>\nTwo plus two.\n</think>\n\nThe answer is 4.",
        "\nTwo plus two.\n",
        "The answer is 4.",
    ),
    "whitespace_before_think": (False, "\n <think>r</think>c", "r", "c"),
    "opened_by_prompt": (True, "Two plus two.\n</think>\n\n4", "Two plus two.\n", "4"),
    "no_reasoning": (
        False,
        "\n  <thinking is not the tag",
        "",
        "\n  <thinking is not the tag",
    ),
    "tag_inside_content": (
        False,
        "Use <think> and </think> tags.",
        "",
        "Use <think> and </think> tags.",
    ),
    "second_end_tag_is_content": (
        False,
        "<think>a<b</think>\n</think> c",
        "a<b",
        "</think> c",
    ),
    "ends_inside_reasoning": (
        False,
        "<think>\nstill going </thi",
        "\nstill going </thi",
        "",
    ),
    "ends_inside_start_tag": (False, "  <thi", "", "  <thi"),
    "only_whitespace_after_end": (True, "done</think>\n\n", "done", ""),
}


def run(starts_in_reasoning: bool, pieces: list[str]) -> tuple[str, str]:
    parser = ReasoningParser(starts_in_reasoning=starts_in_reasoning)
    reasoning, content = [], []
    for piece in pieces:
        reasoning_delta, content_delta = parser.feed(piece)
        reasoning.append(reasoning_delta)
        content.append(content_delta)
    reasoning_delta, content_delta = parser.finish()
    return "".join(reasoning) + reasoning_delta, "".join(content) + content_delta


@pytest.mark.parametrize("name", sorted(CASES))
def test_whole_text(name: str) -> None:
    starts_in_reasoning, text, reasoning, content = CASES[name]
    assert run(starts_in_reasoning, [text]) == (reasoning, content)


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_split_gives_the_same_result(name: str) -> None:
    starts_in_reasoning, text, reasoning, content = CASES[name]
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        assert run(starts_in_reasoning, pieces) == (reasoning, content), pieces


def test_reasoning_streams_before_the_end_tag() -> None:
    parser = ReasoningParser()
    assert parser.feed("<thi") == ("", "")
    assert parser.feed("nk>Let me see</") == ("Let me see", "")
    assert parser.feed("think>\n") == ("", "")
    assert parser.feed("\nSo 4.") == ("", "So 4.")
    assert parser.feed("\n\nDone") == ("", "\n\nDone")
    assert parser.finish() == ("", "")


def test_custom_tags() -> None:
    parser = ReasoningParser("<reasoning>", "</reasoning>")
    assert parser.feed("<reasoning>hm</reasoning> <think>x</think>") == (
        "hm",
        "<think>x</think>",
    )


@pytest.mark.parametrize(
    ("template", "enable_thinking", "suffix", "opened"),
    [
        ("Qwen-Qwen3-0.6B.jinja", True, "<|im_start|>assistant\n", False),
        (
            "Qwen-Qwen3-0.6B.jinja",
            False,
            "<|im_start|>assistant\n<think>\n\n</think>\n\n",
            False,
        ),
        ("Qwen3.5-4B.jinja", True, "<|im_start|>assistant\n<think>\n", True),
        (
            "Qwen3.5-4B.jinja",
            False,
            "<|im_start|>assistant\n<think>\n\n</think>\n\n",
            False,
        ),
    ],
)
def test_opens_in_prompt(
    template: str, enable_thinking: bool, suffix: str, opened: bool
) -> None:
    prompt = ChatTemplate((TEMPLATES / template).read_text()).render(
        MESSAGES, enable_thinking=enable_thinking
    )
    assert prompt.endswith(suffix)
    assert opens_in_prompt(prompt) is opened


def test_opens_in_prompt_after_closed_history() -> None:
    history = "<think>\nold\n</think>\n\nold answer<|im_end|>\n<|im_start|>assistant\n"
    assert opens_in_prompt(history) is False
    assert opens_in_prompt(history + "<think>\n") is True


def test_chained_into_the_tool_parser() -> None:
    # Qwen3.5 with thinking: the prompt opened <think>, the model reasons, then calls a tool.
    text = (
        "The user wants weather. <tool_call> is how I call.\n</think>\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
    )
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {}},
            },
        }
    ]
    reasoning_parser = ReasoningParser(starts_in_reasoning=True)
    tool_parser = make_tool_parser(QWEN_XML, tools)
    reasoning, content = [], []
    for character in text:
        reasoning_delta, content_delta = reasoning_parser.feed(character)
        reasoning.append(reasoning_delta)
        content.append(tool_parser.feed(content_delta).content)
    reasoning_delta, content_delta = reasoning_parser.finish()
    content.append(
        tool_parser.feed(content_delta).content + tool_parser.finish(False).content
    )
    assert (
        "".join(reasoning) + reasoning_delta
        == "The user wants weather. <tool_call> is how I call.\n"
    )
    assert "".join(content) == ""
    assert [(call.name, call.arguments) for call in tool_parser.tool_calls] == [
        ("get_weather", '{"city":"Oslo"}')
    ]
