"""Tool-call parsing of generated text in both Qwen dialects, streamed in arbitrary pieces, and the generic tool
prompt."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from basert.chat.prompt import ChatPlan
from basert.chat.reply import TurnEnd
from basert.chat.tool_calls import (
    CLOSE_TAG,
    OPEN_TAG,
    QWEN_JSON,
    QWEN_XML,
    ToolCall,
    ToolCallDelta,
    detect_dialect,
    inject_tool_prompt,
    make_tool_parser,
    tool_system_prompt,
)

TEMPLATES = Path(__file__).parent / "fixtures" / "chat-templates"


def function_tool(name: str, properties: dict) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"The {name} tool.",
            "parameters": {"type": "object", "properties": properties},
        },
    }


WEATHER = function_tool(
    "get_weather", {"city": {"type": "string"}, "days": {"type": "integer"}}
)
CONFIGURE = function_tool(
    "configure",
    {
        "count": {"type": "integer"},
        "ratio": {"type": "number"},
        "scale": {"type": "number"},
        "enabled": {"type": "boolean"},
        "options": {"type": "object"},
        "tags": {"type": "array"},
        "parent": {"type": ["integer", "null"]},
        "script": {"type": "string"},
    },
)
TOOLS = [WEATHER, CONFIGURE]


@dataclass(slots=True)
class Case:
    dialect: str
    text: str
    content: str
    calls: list[tuple[str, str]]
    truncated: bool = False


CASES = {
    "json_two_calls": Case(
        QWEN_JSON,
        "Let me check both cities.\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        "Both requested.",
        "Let me check both cities.\n\nBoth requested.",
        [
            ("get_weather", '{"city":"Zürich","days":3}'),
            ("get_weather", '{"city":"Oslo"}'),
        ],
    ),
    "xml_typed": Case(
        QWEN_XML,
        "I will configure it.\n\n<tool_call>\n<function=configure>\n"
        "<parameter=count>\n3\n</parameter>\n"
        "<parameter=ratio>\n0.25\n</parameter>\n"
        "<parameter=scale>\n2\n</parameter>\n"
        "<parameter=enabled>\nTrue\n</parameter>\n"
        '<parameter=options>\n{"mode": "fast", "depth": 2}\n</parameter>\n'
        '<parameter=tags>\n["a", "b"]\n</parameter>\n'
        "<parameter=parent>\nnull\n</parameter>\n"
        "<parameter=script>\nline one\n  line two <b>\n\n</parameter>\n"
        "<parameter=note>\n42\n</parameter>\n"
        "</function>\n</tool_call>\n"
        "<tool_call>\n<function=lookup>\n<parameter=id>\n7\n</parameter>\n</function>\n</tool_call>",
        "I will configure it.",
        [
            (
                "configure",
                (
                    '{"count":3,"ratio":0.25,"scale":2,"enabled":true,"options":{"mode":"fast","depth":2},'
                    '"tags":["a","b"],"parent":null,"script":"line one\\n  line two <b>\\n","note":"42"}'
                ),
            ),
            ("lookup", '{"id":"7"}'),
        ],
    ),
    "no_calls": Case(
        QWEN_JSON,
        "\n\nCompare a < b, <tool_cal is not a tag, nor is <tool_call without its bracket <\n\n",
        "\n\nCompare a < b, <tool_cal is not a tag, nor is <tool_call without its bracket <\n\n",
        [],
    ),
    # A call cut off is content, even after its head and first argument went out as a call.
    "truncated_json": Case(
        QWEN_JSON,
        'Looking it up.\n<tool_call>\n{"name": "get_weather", "arguments": {"days": 2, "city": "Par',
        'Looking it up.\n<tool_call>\n{"name": "get_weather", "arguments": {"days": 2, "city": "Par',
        [],
        truncated=True,
    ),
    "truncated_xml_after_call": Case(
        QWEN_XML,
        "<tool_call>\n<function=lookup>\n<parameter=id>\n1\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=lookup>\n<parameter=id>\n2\n</parameter>\n</function>\n</tool_",
        "<tool_call>\n<function=lookup>\n<parameter=id>\n2\n</parameter>\n</function>\n</tool_",
        [("lookup", '{"id":"1"}')],
        truncated=True,
    ),
    # Without a complete head (name and the opening of the arguments) an unterminated call is content.
    "truncated_before_the_head": Case(
        QWEN_JSON,
        'Looking it up.\n<tool_call>\n{"name": "get_wea',
        'Looking it up.\n<tool_call>\n{"name": "get_wea',
        [],
        truncated=True,
    ),
    # A call that repeats an earlier one of the turn (its arguments in any order and spacing) ends the turn: it
    # and all after it are dropped.
    "json_repeat_ends_the_turn": Case(
        QWEN_JSON,
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name":"get_weather","arguments":{"days":3,"city":"Oslo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "configure", "arguments": {}}\n</tool_call>\nMore text.',
        "Checking.",
        [("get_weather", '{"city":"Oslo","days":3}'), ("get_weather", '{"city":"Paris"}')],
    ),
    # Arguments given as a JSON string (no streamed head) repeat a call all the same.
    "json_repeat_without_a_streamed_head": Case(
        QWEN_JSON,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>\nMore.',
        "",
        [("get_weather", '{"city":"Oslo"}')],
    ),
    "xml_repeat_ends_the_turn": Case(
        QWEN_XML,
        "<tool_call>\n<function=configure>\n<parameter=count>\n3\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=configure>\n<parameter=count>\n3\n</parameter>\n</function>\n</tool_call>",
        "",
        [("configure", '{"count":3}')],
    ),
    # The same name with other arguments (JSON-wise: 3 and 3.0 differ, as do a subset and the whole) is kept.
    "json_other_arguments_are_kept": Case(
        QWEN_JSON,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3.0}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "configure", "arguments": {"city": "Oslo"}}\n</tool_call>\nDone.',
        "Done.",
        [("get_weather", '{"city":"Oslo","days":3}'), ("get_weather", '{"city":"Oslo","days":3.0}'),
         ("get_weather", '{"city":"Oslo"}'), ("configure", '{"city":"Oslo"}')],
    ),
}


@dataclass(slots=True)
class Outcome:
    content: str
    streamed_before_finish: list[str]
    calls: list[tuple[str, str]]
    deltas: list[ToolCallDelta]
    parser_calls: list[ToolCall]


def run(case: Case, pieces: list[str]) -> Outcome:
    parser = make_tool_parser(case.dialect, TOOLS)
    streamed: list[str] = []
    deltas: list[ToolCallDelta] = []
    for piece in pieces:
        events = parser.feed(piece)
        streamed.append(events.content)
        deltas.extend(events.tool_deltas)
    final = parser.finish(case.truncated)
    deltas.extend(final.tool_deltas)
    content = "".join(streamed) + final.content
    assert parser.content == content
    return Outcome(
        content,
        streamed,
        [(call.name, call.arguments) for call in parser.tool_calls],
        deltas,
        parser.tool_calls,
    )


def arguments_by_call(outcome: Outcome) -> list[str]:
    """The streamed arguments of each call the parser returned; every other call that went out in the stream
    (cut off, or malformed after its head) has arguments that are not complete JSON."""
    joined: dict[int, str] = {}
    index_of: dict[str, int] = {}
    for delta in outcome.deltas:
        joined[delta.index] = joined.get(delta.index, "") + delta.arguments
        if delta.id is not None:
            index_of[delta.id] = delta.index
    returned = [index_of[call.id] for call in outcome.parser_calls]
    for index in set(joined) - set(returned):
        with pytest.raises(json.JSONDecodeError):
            json.loads(joined[index])
    return [joined[index] for index in returned]


def every_split(text: str) -> list[list[str]]:
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_whole_text(name: str) -> None:
    case = CASES[name]
    outcome = run(case, [case.text])
    assert outcome.content == case.content
    assert outcome.calls == case.calls
    assert arguments_by_call(outcome) == [
        arguments for _, arguments in case.calls
    ]


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_split_gives_the_same_result(name: str) -> None:
    case = CASES[name]
    for pieces in every_split(case.text):
        outcome = run(case, pieces)
        assert (outcome.content, outcome.calls) == (case.content, case.calls), pieces
        assert arguments_by_call(outcome) == [
            arguments for _, arguments in case.calls
        ], pieces


@pytest.mark.parametrize("name", sorted(CASES))
def test_streamed_content_never_holds_a_tag_fragment(name: str) -> None:
    # Until finish, no "<tool_call>" (or a start of it that became a tag) may reach the client.
    case = CASES[name]
    tag_start = case.text.find(OPEN_TAG)
    for pieces in every_split(case.text):
        streamed = "".join(run(case, pieces).streamed_before_finish)
        assert OPEN_TAG not in streamed
        if tag_start >= 0:
            assert "<" not in streamed, pieces


def test_first_delta_of_each_call_carries_id_and_name() -> None:
    case = CASES["json_two_calls"]
    outcome = run(case, list(case.text))
    heads = [delta for delta in outcome.deltas if delta.id is not None]
    assert [(delta.index, delta.name, delta.arguments) for delta in heads] == [
        (0, "get_weather", ""),
        (1, "get_weather", ""),
    ]
    assert [delta.id for delta in heads] == [call.id for call in outcome.parser_calls]
    # Each call's first delta comes before any of its argument fragments.
    first_of = {delta.index: position for position, delta in reversed(list(enumerate(outcome.deltas)))}
    assert all(outcome.deltas[first_of[index]].id is not None for index in first_of)
    assert heads[0].to_openai() == {
        "index": 0,
        "id": outcome.parser_calls[0].id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }


def test_argument_fragment_delta_shape() -> None:
    assert ToolCallDelta(1, None, None, '"x"}').to_openai() == {
        "index": 1,
        "function": {"arguments": '"x"}'},
    }


@pytest.mark.parametrize(
    ("dialect", "pieces", "fragments"),
    [
        (
            QWEN_JSON,
            ['<tool_call>\n{"name": "get_weather", "arguments": {', '"city": "Oslo"', ",", ' "days": 3', "}",
             "}\n</tool_call", ">"],
            ["", "", '{"city":"Oslo"', "", ',"days":3', "", "}"],
        ),
        (
            QWEN_XML,
            ["<tool_call>\n<function=get_weather>\n", "<parameter=city>\nOslo\n</parameter>\n",
             "<parameter=days>\n3\n</param", "eter>\n</function>\n</tool_call>"],
            ["", '{"city":"Oslo"', "", ',"days":3}'],
        ),
    ],
)
def test_arguments_stream_as_each_one_completes(dialect: str, pieces: list[str], fragments: list[str]) -> None:
    """The head goes out once the arguments open, then one compact fragment per complete argument, before the
    closing tag; the fragments join into the call's arguments."""
    parser = make_tool_parser(dialect, TOOLS)
    sent = []
    for piece in pieces:
        deltas = parser.feed(piece).tool_deltas
        sent.append("".join(delta.arguments for delta in deltas))
        assert [delta.name for delta in deltas if delta.id is not None] in ([], ["get_weather"])
    assert sent == fragments
    assert parser.finish(False).tool_deltas == []
    [call] = parser.tool_calls
    assert (call.name, call.arguments) == ("get_weather", '{"city":"Oslo","days":3}')


def test_a_call_that_could_repeat_an_earlier_one_is_held_until_it_differs() -> None:
    """While its name and arguments so far agree with an earlier call, nothing of a call goes out; once one
    argument differs, its head and the arguments so far go out, then it streams as any call."""
    parser = make_tool_parser(QWEN_JSON, TOOLS)
    first = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>\n'
    parser.feed(first)
    pieces = ['<tool_call>\n{"name": "get_weather", "arguments": {', '"city": "Oslo", ', '"days": 4, ',
              '"unit": "C"', "}}\n</tool_call>"]
    sent = [[(d.index, d.name, d.arguments) for d in parser.feed(piece).tool_deltas] for piece in pieces]
    assert sent == [[], [], [(1, "get_weather", ""), (1, None, '{"city":"Oslo","days":4')], [],
                    [(1, None, ',"unit":"C"'), (1, None, "}")]]
    assert not parser.turn_over
    repeat = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>'
    assert [parser.feed(char).tool_deltas for char in repeat] == [[]] * len(repeat)
    assert parser.turn_over
    assert parser.feed("After.").content == "" and parser.finish(False).content == ""
    assert [call.arguments for call in parser.tool_calls] == ['{"city":"Oslo","days":3}',
                                                             '{"city":"Oslo","days":4,"unit":"C"}']


def test_the_turn_ends_on_the_character_that_closes_a_repeat_or_the_last_allowed_call() -> None:
    """TurnEnd, as the engine asks it after every token, says the turn is over exactly where the reply's parser
    ends it: at the close of a repeated call, or of the last call the turn may make; a call inside reasoning does
    not count."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    other = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    plan = ChatPlan([], TOOLS, starts_in_reasoning=False, has_reasoning=True)
    for text, max_calls, closes in [
        (f"<think>{call}\n{call}</think>{call}\n{other}\n{call}\nrest", 8, 5),
        (f"{call}\n{other}\n{other}", 2, 2),
    ]:
        turn = TurnEnd(plan, QWEN_JSON, max_calls)
        end = next(i for i in range(len(text) + 1) if turn.reached(text[:i]))
        assert text[:end].endswith(CLOSE_TAG)
        assert text[:end].count(CLOSE_TAG) == closes


def test_call_ids_are_unique_and_prefixed() -> None:
    parser = make_tool_parser(QWEN_JSON, TOOLS, id_prefix="chatcmpl-tool-")
    parser.feed(CASES["json_two_calls"].text)
    parser.finish(False)
    ids = [call.id for call in parser.tool_calls]
    assert len(set(ids)) == 2
    assert all(
        call_id.startswith("chatcmpl-tool-")
        and len(call_id) == len("chatcmpl-tool-") + 24
        for call_id in ids
    )


def test_tool_call_to_openai() -> None:
    call = ToolCall("call_abc", "get_weather", '{"city":"Oslo"}')
    assert call.to_openai() == {
        "id": "call_abc",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
    }


def parse(
    dialect: str, text: str, *, truncated: bool = False, tools: list[dict] | None = None
) -> tuple[str, list]:
    parser = make_tool_parser(dialect, TOOLS if tools is None else tools)
    parser.feed(text)
    parser.finish(truncated)
    return parser.content, [(call.name, call.arguments) for call in parser.tool_calls]


@pytest.mark.parametrize("truncated", [True, False])
def test_unterminated_call_is_content(truncated: bool) -> None:
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
    assert parse(QWEN_JSON, text, truncated=truncated) == (text, [])


@pytest.mark.parametrize(
    ("dialect", "body"),
    [
        (QWEN_JSON, '{"name": "get_weather", "arguments": {"city": }}'),
        (QWEN_JSON, '{"arguments": {"city": "Oslo"}}'),
        (QWEN_JSON, '{"name": "get_weather", "arguments": ["Oslo"]}'),
        (QWEN_JSON, '{"name": "get_weather", "arguments": "not json"}'),
        (QWEN_JSON, '{"name": "get_weather", "arguments": {"city": "Oslo", "days": NaN}}'),
        (QWEN_JSON, '{"name": "", "arguments": {}}'),
        (QWEN_JSON, '["get_weather"]'),
        (QWEN_JSON, "[" * 100_000),
        (QWEN_XML, "<parameter=city>\nOslo\n</parameter>"),
        (QWEN_XML, "<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\nstray text\n</function>"),
        (QWEN_XML, "<function=get_weather>\n<parameter=city>\nOslo\n</function>"),
        (QWEN_XML, "<function=>\n</function>"),
    ],
)
def test_malformed_call_is_content(dialect: str, body: str) -> None:
    """Whatever went out in the stream before the body turned out malformed, it is content, and the streamed
    call never gets the fragment that would complete its arguments."""
    text = f"Before.\n{OPEN_TAG}\n{body}\n{CLOSE_TAG}\nAfter."
    case = Case(dialect, text, text, [])
    for pieces in ([text], list(text)):
        outcome = run(case, pieces)
        assert (outcome.content, outcome.calls) == (text, [])
        assert arguments_by_call(outcome) == []


def test_malformed_call_does_not_take_an_index() -> None:
    text = '<tool_call>\n{"name": }\n</tool_call><tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    parser = make_tool_parser(QWEN_JSON, TOOLS)
    deltas = parser.feed(text).tool_deltas + parser.finish(False).tool_deltas
    assert [(delta.index, delta.name, delta.arguments) for delta in deltas] == [
        (0, "get_weather", ""), (0, None, "{}")
    ]
    assert parser.content == '<tool_call>\n{"name": }\n</tool_call>'


@pytest.mark.parametrize(
    ("body", "arguments"),
    [
        ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', '{"city":"Oslo"}'),
        (
            '{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}',
            '{"city":"Oslo"}',
        ),
        ('{"name": "get_weather"}', "{}"),
        ('{"name": "get_weather", "arguments": null}', "{}"),
        (
            '{"name": "get_weather", "arguments": {"note": "a<b \\u00e9"}}',
            '{"note":"a<b é"}',
        ),
    ],
)
def test_json_dialect_argument_forms(body: str, arguments: str) -> None:
    assert parse(QWEN_JSON, f"{OPEN_TAG}\n{body}\n{CLOSE_TAG}") == (
        "",
        [("get_weather", arguments)],
    )


def test_whitespace_between_content_and_calls() -> None:
    call = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    other = '<tool_call>\n{"name": "configure", "arguments": {}}\n</tool_call>'
    # Whitespace only around calls is dropped; between two pieces of content it stays, once.
    assert parse(QWEN_JSON, f"\n\n{call}\n\n{other}\n\n")[0] == ""
    assert (
        parse(QWEN_JSON, f"Before.\n\n{call}\n{other}\nAfter.")[0] == "Before.\n\nAfter."
    )
    assert parse(QWEN_JSON, f"\n\n{call}\n\nAfter.")[0] == "After."


def xml_value(schema: dict | None, raw: str, function: str = "f") -> str:
    properties = {} if schema is None else {"p": schema}
    text = f"{OPEN_TAG}\n<function={function}>\n<parameter=p>\n{raw}\n</parameter>\n</function>\n{CLOSE_TAG}"
    content, calls = parse(QWEN_XML, text, tools=[function_tool("f", properties)])
    assert content == ""
    [(name, arguments)] = calls
    assert name == function
    return arguments


@pytest.mark.parametrize(
    ("schema", "raw", "arguments"),
    [
        ({"type": "integer"}, "42", '{"p":42}'),
        ({"type": "integer"}, "-7", '{"p":-7}'),
        ({"type": "integer"}, "4.5", '{"p":"4.5"}'),
        ({"type": "integer"}, "1_000", '{"p":"1_000"}'),
        ({"type": "integer"}, "forty", '{"p":"forty"}'),
        ({"type": "number"}, "3", '{"p":3}'),
        ({"type": "number"}, "2.5", '{"p":2.5}'),
        ({"type": "number"}, "-1e3", '{"p":-1000.0}'),
        ({"type": "number"}, "1e999", '{"p":"1e999"}'),
        ({"type": "number"}, "nan", '{"p":"nan"}'),
        ({"type": "boolean"}, "true", '{"p":true}'),
        ({"type": "boolean"}, "False", '{"p":false}'),
        ({"type": "boolean"}, "yes", '{"p":"yes"}'),
        ({"type": "null"}, "null", '{"p":null}'),
        ({"type": "null"}, "None", '{"p":"None"}'),
        ({"type": "object"}, '{"a": [1, {"b": null}]}', '{"p":{"a":[1,{"b":null}]}}'),
        ({"type": "object"}, "[1]", '{"p":"[1]"}'),
        ({"type": "object"}, "{bad", '{"p":"{bad"}'),
        ({"type": "array"}, '[1, "x"]', '{"p":[1,"x"]}'),
        ({"type": "array"}, '{"a": 1}', '{"p":"{\\"a\\": 1}"}'),
        ({"type": "string"}, "42", '{"p":"42"}'),
        ({"type": "string"}, "true", '{"p":"true"}'),
        ({"type": "string"}, "\n  indented\n", '{"p":"\\n  indented\\n"}'),
        ({"type": ["integer", "null"]}, "null", '{"p":null}'),
        ({"type": ["integer", "null"]}, "5", '{"p":5}'),
        ({"type": ["integer", "null"]}, "five", '{"p":"five"}'),
        ({"type": ["string", "integer"]}, "5", '{"p":5}'),
        ({"description": "no type"}, "5", '{"p":"5"}'),
        (None, "5", '{"p":"5"}'),
    ],
)
def test_xml_coercion(schema: dict | None, raw: str, arguments: str) -> None:
    assert xml_value(schema, raw) == arguments


def test_xml_unknown_function_keeps_strings() -> None:
    assert xml_value({"type": "integer"}, "5", function="other") == '{"p":"5"}'


def test_xml_call_without_parameters() -> None:
    text = f"{OPEN_TAG}\n<function=get_time>\n</function>\n{CLOSE_TAG}"
    assert parse(QWEN_XML, text) == ("", [("get_time", "{}")])


def test_interleaved_parsers_are_independent() -> None:
    first, second = CASES["json_two_calls"], CASES["xml_typed"]
    parsers = [
        make_tool_parser(first.dialect, TOOLS),
        make_tool_parser(second.dialect, TOOLS),
    ]
    for position in range(max(len(first.text), len(second.text))):
        parsers[0].feed(first.text[position : position + 1])
        parsers[1].feed(second.text[position : position + 1])
    for parser, case in zip(parsers, (first, second)):
        parser.finish(False)
        assert (
            parser.content,
            [(call.name, call.arguments) for call in parser.tool_calls],
        ) == (case.content, case.calls)


@pytest.mark.parametrize(
    ("template", "dialect"),
    [
        ("Qwen-Qwen3-0.6B.jinja", QWEN_JSON),
        ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", QWEN_JSON),
        ("Qwen3.5-4B.jinja", QWEN_XML),
        ("Qwen3-Coder.jinja", QWEN_XML),
    ],
)
def test_detect_dialect_of_real_templates(template: str, dialect: str) -> None:
    assert detect_dialect((TEMPLATES / template).read_text()) == dialect


def test_detect_dialect_without_tool_support() -> None:
    assert detect_dialect(None) == QWEN_JSON
    assert (
        detect_dialect("{% for m in messages %}{{ m.content }}{% endfor %}")
        == QWEN_JSON
    )


def test_unknown_dialect() -> None:
    with pytest.raises(ValueError, match="unknown tool-call dialect 'mistral'"):
        make_tool_parser("mistral", TOOLS)


def test_tool_system_prompt() -> None:
    prompt = tool_system_prompt([WEATHER, CONFIGURE])
    assert (
        f"<tools>\n{json.dumps(WEATHER, ensure_ascii=False)}\n{json.dumps(CONFIGURE, ensure_ascii=False)}\n</tools>"
        in prompt
    )
    assert prompt.endswith(
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def test_inject_tool_prompt_into_existing_system_message() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
    ]
    original = copy.deepcopy(messages)
    injected = inject_tool_prompt(messages, [WEATHER])
    assert messages == original
    assert injected == [
        {"role": "system", "content": tool_system_prompt([WEATHER]) + "\n\nBe brief."},
        original[1],
    ]


def test_inject_tool_prompt_adds_a_system_message() -> None:
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    original = copy.deepcopy(messages)
    injected = inject_tool_prompt(messages, [WEATHER])
    assert messages == original
    assert injected == [
        {"role": "system", "content": tool_system_prompt([WEATHER])},
        original[0],
    ]


def test_inject_tool_prompt_into_content_parts() -> None:
    messages = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}]
    original = copy.deepcopy(messages)
    injected = inject_tool_prompt(messages, [WEATHER])
    assert messages == original
    assert injected[0]["content"] == [
        {"type": "text", "text": tool_system_prompt([WEATHER])},
        {"type": "text", "text": "Be brief."},
    ]


def test_earlier_tool_calls_are_written_into_their_turns_for_templates_without_tools() -> None:
    """A template without tool support renders an assistant turn's content only: the calls it made are written
    there as the generic prompt asks the model to write them, so the model sees what it called."""
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "-3 C"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": "not json"}}]},
    ]
    original = copy.deepcopy(messages)
    injected = inject_tool_prompt(messages, [WEATHER])
    assert messages == original
    assert injected[2] == {"role": "assistant", "content":
                           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'}
    assert injected[3] == original[2]
    assert injected[4]["content"] == ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": "not json"}\n'
                                      '</tool_call>')
    parser = make_tool_parser(QWEN_JSON, [WEATHER])   # the dialect the generic prompt teaches reads it back
    parser.feed(injected[2]["content"])
    parser.finish(False)
    assert [(c.name, json.loads(c.arguments)) for c in parser.tool_calls] == [("get_weather", {"city": "Oslo"})]
