"""Chat template rendering against the real templates of the model families we serve."""

from __future__ import annotations

import copy
from datetime import datetime
from pathlib import Path

import pytest

from basert.chat.template import ChatTemplate, ChatTemplateError

TEMPLATES = Path(__file__).parent / "fixtures" / "chat-templates"
QWEN3 = "Qwen-Qwen3-0.6B.jinja"
QWEN35 = "Qwen3.5-4B.jinja"
QWEN3_CODER = "Qwen3-Coder.jinja"
HERMES3 = "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja"


def load(name: str, **tokens: str) -> ChatTemplate:
    return ChatTemplate((TEMPLATES / name).read_text(), **tokens)


def weather_tool() -> dict:
    return {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather forecast for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name"},
                    "days": {"type": "integer", "description": "Number of days"},
                },
                "required": ["city"],
            },
        },
    }


def time_tool() -> dict:
    return {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Get the local time in a timezone.",
            "parameters": {
                "type": "object",
                "properties": {"timezone": {"type": "string", "description": "IANA timezone"}},
                "required": ["timezone"],
            },
        },
    }


def weather_call(arguments: str = '{"city": "Paris", "days": 2}') -> dict:
    """An assistant turn as OpenAI clients send it back: no content, arguments as a JSON string."""
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        ],
    }


def tool_conversation() -> list[dict]:
    return [
        {"role": "user", "content": "Weather in Paris for 2 days?"},
        weather_call(),
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18}'},
        {"role": "user", "content": "And the time there?"},
    ]


SYSTEM_AND_USER = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
]
CHATML_SYSTEM_AND_USER = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (QWEN3, CHATML_SYSTEM_AND_USER + "<|im_start|>assistant\n"),
        (QWEN3_CODER, CHATML_SYSTEM_AND_USER + "<|im_start|>assistant\n"),
        (QWEN35, CHATML_SYSTEM_AND_USER + "<|im_start|>assistant\n<think>\n"),
    ],
)
def test_system_and_user_with_generation_prompt(name: str, expected: str) -> None:
    assert load(name).render(SYSTEM_AND_USER, add_generation_prompt=True) == expected


def test_hermes_tool_use_template_needs_tools_like_hf() -> None:
    # HF passes tools=None when there are none, and this template iterates `tools` unguarded;
    # Hermes ships it next to a "default" template that HF picks when no tools are given.
    with pytest.raises(ChatTemplateError) as info:
        load(HERMES3).render(SYSTEM_AND_USER)
    assert str(info.value) == "chat template failed to render: TypeError: 'NoneType' object is not iterable"


def test_hermes_system_and_user_with_tools() -> None:
    rendered = load(HERMES3, bos_token="<|begin_of_text|>").render(SYSTEM_AND_USER, tools=[weather_tool()])
    assert rendered.startswith("<|begin_of_text|><|im_start|>system\nYou are a function calling AI model.")
    assert rendered.endswith(
        "</tool_call><|im_end|>\n" + CHATML_SYSTEM_AND_USER + "<|im_start|>assistant\n"
    )


XML_WEATHER_CALL = (
    "<tool_call>\n<function=get_weather>\n"
    "<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n2\n</parameter>\n"
    "</function>\n</tool_call><|im_end|>\n"
)
JSON_WEATHER_CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call><|im_end|>\n'
)
TOOLS_AS_JSON = (
    '<tools>\n{"type": "function", "function": {"name": "get_weather", '
    '"description": "Get the weather forecast for a city.", "parameters": {"type": "object", '
    '"properties": {"city": {"type": "string", "description": "City name"}, '
    '"days": {"type": "integer", "description": "Number of days"}}, "required": ["city"]}}}\n'
    '{"type": "function", "function": {"name": "get_time", '
    '"description": "Get the local time in a timezone.", "parameters": {"type": "object", '
    '"properties": {"timezone": {"type": "string", "description": "IANA timezone"}}, '
    '"required": ["timezone"]}}}\n</tools>'
)
FINAL_USER = "<|im_start|>user\nAnd the time there?<|im_end|>\n"


@pytest.mark.parametrize(
    ("name", "markers", "ending"),
    [
        (
            QWEN3,
            [
                TOOLS_AS_JSON,
                "<|im_start|>assistant\n" + JSON_WEATHER_CALL,
                "<|im_start|>user\n<tool_response>\n{\"temp_c\": 18}\n</tool_response><|im_end|>\n",
            ],
            FINAL_USER + "<|im_start|>assistant\n",
        ),
        (
            QWEN35,
            [
                TOOLS_AS_JSON,
                "<|im_start|>assistant\n" + XML_WEATHER_CALL,
                "<|im_start|>user\n<tool_response>\n{\"temp_c\": 18}\n</tool_response><|im_end|>\n",
            ],
            FINAL_USER + "<|im_start|>assistant\n<think>\n",
        ),
        (
            QWEN3_CODER,
            [
                "<tools>\n<function>\n<name>get_weather</name>\n",
                "<function>\n<name>get_time</name>\n<description>Get the local time in a timezone.</description>\n",
                "<|im_start|>assistant\n" + XML_WEATHER_CALL,
                "<|im_start|>user\n<tool_response>\n{\"temp_c\": 18}\n</tool_response>\n<|im_end|>\n",
            ],
            FINAL_USER + "<|im_start|>assistant\n",
        ),
        (
            HERMES3,
            [
                '<tools> {"type": "function", "function": {"name": "get_weather", '
                '"description": "get_weather(city: str, days: int) - Get the weather forecast for a city.',
                '{"type": "function", "function": {"name": "get_time", "description": "get_time(timezone: str)',
                "<|im_start|>assistant\n" + JSON_WEATHER_CALL,
                "<|im_start|>tool\n<tool_response>\n{\"temp_c\": 18}\n</tool_response>\n<|im_end|>",
            ],
            FINAL_USER + "<|im_start|>assistant\n",
        ),
    ],
)
def test_tool_conversation_markers(name: str, markers: list[str], ending: str) -> None:
    rendered = load(name).render(tool_conversation(), tools=[weather_tool(), time_tool()])
    positions = [rendered.find(marker) for marker in markers]
    assert all(position >= 0 for position in positions), list(zip(markers, positions))
    assert positions == sorted(positions)
    assert rendered.endswith(ending)


QWEN35_WEATHER_PROMPT = (
    "<|im_start|>system\n"
    "# Tools\n\nYou have access to the following functions:\n\n"
    "<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Get the weather forecast for a city.", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}, '
    '"days": {"type": "integer", "description": "Number of days"}}, "required": ["city"]}}}\n'
    "</tools>"
    "\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n"
    "<IMPORTANT>\nReminder:\n"
    "- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested "
    "within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language BEFORE the function call, "
    "but NOT after\n"
    "- If there is no function call available, answer the question like normal with your current knowledge and "
    "do not tell the user about function calls\n"
    "</IMPORTANT>"
    "\n\nYou are a helpful assistant."
    "<|im_end|>\n"
    "<|im_start|>user\nWeather in Paris for 2 days?<|im_end|>\n"
    # The call follows the last user query, so it carries an (empty) thinking block.
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    "<tool_call>\n<function=get_weather>\n"
    "<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n2\n</parameter>\n"
    "</function>\n</tool_call><|im_end|>\n"
    '<|im_start|>user\n<tool_response>\n{"temp_c": 18}\n</tool_response><|im_end|>\n'
    "<|im_start|>assistant\n<think>\n"
)


def test_qwen35_tool_call_conversation_exact_text() -> None:
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Weather in Paris for 2 days?"},
        weather_call(),
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18}'},
    ]
    rendered = load(QWEN35).render(messages, tools=[weather_tool()], add_generation_prompt=True)
    assert rendered == QWEN35_WEATHER_PROMPT


@pytest.mark.parametrize(
    ("kwargs", "suffix"),
    [
        ({}, ""),
        ({"enable_thinking": True}, ""),
        ({"enable_thinking": False}, "<think>\n\n</think>\n\n"),
    ],
)
def test_qwen3_enable_thinking(kwargs: dict, suffix: str) -> None:
    rendered = load(QWEN3).render(SYSTEM_AND_USER, **kwargs)
    assert rendered == CHATML_SYSTEM_AND_USER + "<|im_start|>assistant\n" + suffix


def test_no_generation_prompt() -> None:
    assert load(QWEN3).render(SYSTEM_AND_USER, add_generation_prompt=False) == CHATML_SYSTEM_AND_USER


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([{"role": "system", "content": "Only a system prompt."}], "No user query found in messages."),
        ([{"role": "user", "content": "Hi"}, {"role": "narrator", "content": "Meanwhile"}], "Unexpected message role."),
        (
            [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Late"}],
            "System message must be at the beginning.",
        ),
    ],
)
def test_raise_exception_in_template(messages: list[dict], message: str) -> None:
    with pytest.raises(ChatTemplateError) as info:
        load(QWEN35).render(messages)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("{{ ''.__class__.__mro__ }}", "SecurityError: access to attribute '__class__' of 'str' object is unsafe."),
        ("{{ messages.append(1) }}", "SecurityError: access to attribute 'append' of 'list' object is unsafe."),
        ("{{ messages[0].update({}) }}", "SecurityError: access to attribute 'update' of 'dict' object is unsafe."),
        ("{{ messages[0].nope.deeper }}", "UndefinedError: 'dict object' has no attribute 'nope'"),
        ("{{ messages[0].content + 1 }}", 'TypeError: can only concatenate str (not "int") to str'),
        ("{{ messages[0].nope|tojson }}", "TypeError: Object of type Undefined is not JSON serializable"),
    ],
)
def test_render_errors_are_chat_template_errors(source: str, message: str) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(ChatTemplateError) as info:
        ChatTemplate(source).render(messages)
    assert str(info.value) == "chat template failed to render: " + message
    assert messages == [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            "{{ bos_token }}\n{{ messages + }}\n",
            "chat template syntax error at line 2: unexpected 'end of print statement'",
        ),
        ("{{ messages|no_such_filter }}", "chat template syntax error at line 1: No filter named 'no_such_filter'."),
    ],
)
def test_syntax_error_at_construction(source: str, message: str) -> None:
    with pytest.raises(ChatTemplateError) as info:
        ChatTemplate(source)
    assert str(info.value) == message


def test_whitespace_control_and_loop_controls_match_hf() -> None:
    # trim_blocks drops the newline after a tag, lstrip_blocks the indent before one; `break` needs loopcontrols.
    template = ChatTemplate(
        "{% for m in messages %}\n  {% if loop.index > 2 %}{% break %}{% endif %}\n  {{ m.content }}\n{% endfor %}"
    )
    messages = [{"role": "user", "content": text} for text in ("a", "b", "c")]
    assert template.render(messages) == "  a\n  b\n"


def test_strftime_now_llama3_style() -> None:
    template = ChatTemplate(
        '{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}'
        '{{- "Today Date: " + date_string + "\\n" }}'
    )
    before = datetime.now().strftime("%d %b %Y")
    rendered = template.render([])
    after = datetime.now().strftime("%d %b %Y")
    assert rendered in {f"Today Date: {before}\n", f"Today Date: {after}\n"}
    assert template.render([], date_string="26 Jul 2024") == "Today Date: 26 Jul 2024\n"


def test_tojson_keeps_non_ascii_and_html_characters() -> None:
    tools = [{"name": "météo", "description": "<b>Wetter</b> & 天气"}]
    assert ChatTemplate("{{ tools|tojson(indent=2) }}").render([], tools=tools) == (
        '[\n  {\n    "name": "météo",\n    "description": "<b>Wetter</b> & 天气"\n  }\n]'
    )
    assert ChatTemplate("{{ tools[0]|tojson(separators=(',', ':'), sort_keys=true) }}").render([], tools=tools) == (
        '{"description":"<b>Wetter</b> & 天气","name":"météo"}'
    )


def test_caller_messages_are_not_mutated() -> None:
    messages = tool_conversation()
    messages[0]["content"] = [{"type": "text", "text": "Weather in Paris for 2 days?"}]
    snapshot = copy.deepcopy(messages)
    load(QWEN35).render(messages, tools=[weather_tool()])
    assert messages == snapshot
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris", "days": 2}'
    assert messages[1]["content"] is None


def test_text_content_parts_are_joined() -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "Line one"}, {"type": "text", "text": "two"}]}]
    assert load(QWEN3).render(messages) == "<|im_start|>user\nLine one\ntwo<|im_end|>\n<|im_start|>assistant\n"


def test_non_text_content_part_is_rejected() -> None:
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]
    with pytest.raises(ChatTemplateError) as info:
        load(QWEN3).render(messages)
    assert str(info.value) == "unsupported message content part type 'image_url'"


@pytest.mark.parametrize(
    ("arguments", "rendered_call"),
    [
        ("not json", '{"name": "get_weather", "arguments": not json}'),
        ("[1, 2]", '{"name": "get_weather", "arguments": [1, 2]}'),
        ("", '{"name": "get_weather", "arguments": {}}'),
        ('{"city":"Paris"}', '{"name": "get_weather", "arguments": {"city": "Paris"}}'),
    ],
)
def test_tool_call_arguments_normalisation(arguments: str, rendered_call: str) -> None:
    # Qwen3 emits a string verbatim and a dict through tojson, which shows what the template received.
    messages = [{"role": "user", "content": "Weather?"}, weather_call(arguments)]
    rendered = load(QWEN3).render(messages, add_generation_prompt=False)
    assert rendered.endswith("\n\n<tool_call>\n" + rendered_call + "\n</tool_call><|im_end|>\n")


@pytest.mark.parametrize("name", [QWEN3, QWEN35, QWEN3_CODER, HERMES3])
def test_real_templates_support_tools(name: str) -> None:
    assert load(name).supports_tools is True


@pytest.mark.parametrize(
    "source",
    [
        "{% for m in messages %}<tools>{{ m.content }}</tools>{% endfor %}",
        "{% set tools = [] %}{{ tools|length }}",
    ],
)
def test_template_without_tools_variable(source: str) -> None:
    assert ChatTemplate(source).supports_tools is False


def test_special_tokens_and_kwargs_reach_the_template() -> None:
    source = "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"
    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    assert template.render([{"role": "user", "content": "Hi"}]) == "<s>Hi</s>"
    assert template.render([{"role": "user", "content": "Hi"}], bos_token="") == "Hi</s>"
