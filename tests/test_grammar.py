"""Grammar-constrained decoding: valid outputs pass token by token, mistakes are masked, random models stop."""

from __future__ import annotations

import json

import numpy as np
import pytest

from basert.chat.grammar import Grammar, GrammarError, GrammarFactory, GrammarMatcher
from basert.chat.tool_calls import QWEN_JSON, QWEN_XML, make_tool_parser
from basert.tokenizer import TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, Tokenizer

# Where Qwen2.5 / Qwen3 vocabularies (the fixture's 151,936-id layout) keep `<tool_call>` and `<think>` as added
# tokens; the vocab-only fixture has padding there, so `qwen35_tagged` puts the four tags back, as Qwen3.5 has them.
TOOL_CALL_ID = 151657
TOOL_CALL_END_ID = 151658
THINK_ID = 151667
THINK_END_ID = 151668
# A model's logits row can be wider than its tokenizer's vocabulary: those ids must never be sampled.
LOGITS_PADDING = 64
RANDOM_STEP_LIMIT = 200
SEEDS = range(5)
# Marks where the mistake starts in an invalid output.
MARK = "|"


def function(name: str, properties: dict, required: list[str]) -> dict:
    """An OpenAI tool entry."""
    parameters = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": parameters}}


LOOKUP = function("lookup_key", {"key": {"type": "string"}}, ["key"])
ADD = function("add", {"a": {"type": "integer"}, "b": {"type": "integer"}, "exact": {"type": "boolean"}}, ["a", "b"])
NOTE = function("note", {"title": {"type": "string"}, "body": {"type": "string"}, "tags": {"type": "array"}}, ["body"])
TOOLS = [LOOKUP, ADD, NOTE]
# Tools whose values a random model cannot make endless: bounded strings, enums, bounded integers.
SET_MODE = function(
    "set_mode",
    {
        "mode": {"type": "string", "enum": ["fast", "slow"]},
        "level": {"type": "integer", "minimum": 0, "maximum": 9},
        "dry_run": {"type": "boolean"},
    },
    ["mode", "level"],
)
SHORT_LOOKUP = function("lookup_key", {"key": {"type": "string", "maxLength": 12}}, ["key"])
RANDOM_JSON_TOOLS = [SHORT_LOOKUP, SET_MODE, ADD]
# The XML dialect writes strings raw and unbounded (see grammar.py), so only typed and enum values here.
RANDOM_XML_TOOLS = [SET_MODE, function("add", {"a": {"type": "integer"}, "b": {"type": "integer"}}, ["a", "b"])]

ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1},
        "status": {"enum": ["new", "paid", "shipped"]},
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 16}, "vip": {"type": "boolean"}},
            "required": ["name", "vip"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"enum": ["A1", "B2"]}, "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["id", "status", "customer", "items"],
    "additionalProperties": False,
}
ORDER = ('{"id":7,"status":"paid","customer":{"name":"Ada","vip":true},'
         '"items":[{"sku":"A1","qty":2},{"sku":"B2","qty":1}]}')

JSON_CALL = '<tool_call>\n{"name":"lookup_key","arguments":{"key":"seq-3"}}\n</tool_call>'
XML_CALL = (
    "<tool_call>\n<function=add>\n<parameter=a>\n3\n</parameter>\n<parameter=b>\n-40\n</parameter>\n"
    "<parameter=exact>\nfalse\n</parameter>\n</function>\n</tool_call>"
)
XML_TEXT_CALL = (
    "<tool_call>\n<function=note>\n<parameter=title>\nTwo lines </param and <b>\n</parameter>\n"
    "<parameter=body>\nfirst\nsecond {\"x\": 1}\n</parameter>\n<parameter=tags>\n[\"a\",2]\n</parameter>\n"
    "</function>\n</tool_call>"
)


def tagged_object(obj: dict) -> dict:
    """The Qwen3.5 vocab object with the tool-call and thinking tags as added tokens at their released ids."""
    tokens = list(obj["tokenizer.ggml.tokens"])
    types = list(obj["tokenizer.ggml.token_type"])
    for token_id, text in ((TOOL_CALL_ID, "<tool_call>"), (TOOL_CALL_END_ID, "</tool_call>"),
                           (THINK_ID, "<think>"), (THINK_END_ID, "</think>")):
        tokens[token_id] = text
        types[token_id] = TOKEN_TYPE_USER_DEFINED
    return {**obj, "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types}


@pytest.fixture(scope="module")
def tokenizers(smollm2_tokenizer: Tokenizer, qwen35_tokenizer: Tokenizer,
               qwen35_tokenizer_object: dict) -> dict[str, Tokenizer]:
    return {
        "smollm2": smollm2_tokenizer,
        "qwen35": qwen35_tokenizer,
        "qwen35_tagged": Tokenizer.from_object(tagged_object(qwen35_tokenizer_object)),
    }


@pytest.fixture(scope="module")
def factories(tokenizers: dict[str, Tokenizer]) -> dict[str, GrammarFactory]:
    return {name: GrammarFactory(tokenizer) for name, tokenizer in tokenizers.items()}


def run_text(matcher: GrammarMatcher, tokenizer: Tokenizer, text: str) -> int | None:
    """Feed `text`'s tokens while each is allowed; the byte offset where the first refused token starts, or None."""
    offset = 0
    for token_id in tokenizer.encode(text):
        if not matcher.allowed_mask()[token_id]:
            return offset
        matcher.consume(token_id)
        offset += len(tokenizer.token_bytes(token_id))
    return None


def assert_refused_at_mark(factory: GrammarFactory, grammar: Grammar, tokenizer: Tokenizer, marked: str) -> None:
    """`marked`, less its MARK, is refused by a token that starts at or before MARK.

    Not always the token holding the byte after MARK: where only one text can follow, llguidance allows only
    its canonical tokens, so "lookup_ke|x" is refused at "ke" (after "lookup" "_", only "key" passes).
    """
    refused = run_text(factory.matcher(grammar), tokenizer, marked.replace(MARK, "", 1))
    assert refused is not None
    assert refused <= len(marked[: marked.index(MARK)].encode())


def allowed_ids(matcher: GrammarMatcher) -> set[int]:
    return set(np.flatnonzero(matcher.allowed_mask()).tolist())


def random_generation(factory: GrammarFactory, grammar: Grammar, tokenizer: Tokenizer, seed: int) -> str:
    """Greedy decoding of random logits under `grammar`, as the engine runs it; the text once the grammar ends."""
    rng = np.random.default_rng(seed)
    matcher = factory.matcher(grammar)
    ids: list[int] = []
    for _ in range(RANDOM_STEP_LIMIT):
        logits = rng.standard_normal(factory.vocab_size + LOGITS_PADDING).astype(np.float32)
        matcher.apply(logits)
        token_id = int(np.argmax(logits))
        assert token_id not in tokenizer.eos_ids, tokenizer.decode(ids)
        matcher.consume(token_id)
        ids.append(token_id)
        if matcher.is_finished:
            return tokenizer.decode(ids)
    raise AssertionError(f"no end after {RANDOM_STEP_LIMIT} tokens: {tokenizer.decode(ids)!r}")


def parse_calls(dialect: str, tools: list[dict], text: str) -> list[tuple[str, dict]]:
    """The (name, arguments) of each call the server's own parser reads from `text`, which holds nothing else."""
    parser = make_tool_parser(dialect, tools)
    events = [parser.feed(text), parser.finish(truncated=False)]
    assert "".join(e.content for e in events) == ""
    return [(call.name, json.loads(call.arguments)) for call in parser.tool_calls]


def check_arguments(name: str, arguments: dict) -> None:
    """Hand validation against RANDOM_JSON_TOOLS / RANDOM_XML_TOOLS."""
    if name == "lookup_key":
        assert set(arguments) == {"key"}
        assert isinstance(arguments["key"], str) and len(arguments["key"]) <= 12
    elif name == "set_mode":
        assert {"mode", "level"} <= set(arguments) <= {"mode", "level", "dry_run"}
        assert arguments["mode"] in ("fast", "slow")
        assert type(arguments["level"]) is int and 0 <= arguments["level"] <= 9
        assert type(arguments.get("dry_run", False)) is bool
    else:
        assert name == "add"
        assert {"a", "b"} <= set(arguments) <= {"a", "b", "exact"}
        assert type(arguments["a"]) is int and type(arguments["b"]) is int
        assert type(arguments.get("exact", False)) is bool


def check_order(doc: dict) -> None:
    """Hand validation against ORDER_SCHEMA."""
    assert list(doc) == ["id", "status", "customer", "items"]
    assert type(doc["id"]) is int and doc["id"] >= 1
    assert doc["status"] in ("new", "paid", "shipped")
    assert list(doc["customer"]) == ["name", "vip"]
    assert isinstance(doc["customer"]["name"], str) and len(doc["customer"]["name"]) <= 16
    assert type(doc["customer"]["vip"]) is bool
    assert 1 <= len(doc["items"]) <= 3
    for item in doc["items"]:
        assert list(item) == ["sku", "qty"]
        assert item["sku"] in ("A1", "B2")
        assert type(item["qty"]) is int and 1 <= item["qty"] <= 99


# --- valid outputs pass token by token ------------------------------------------------------------

@pytest.mark.parametrize("name", ["smollm2", "qwen35", "qwen35_tagged"])
def test_json_dialect_call_passes_then_only_eos(factories, tokenizers, name: str) -> None:
    factory, tokenizer = factories[name], tokenizers[name]
    matcher = factory.matcher(factory.tool_call(TOOLS, QWEN_JSON))
    ids = tokenizer.encode(JSON_CALL)
    for token_id in ids[:-1]:
        assert matcher.allowed_mask()[token_id]
        matcher.consume(token_id)
        assert not matcher.is_finished
    matcher.consume(ids[-1])
    assert matcher.is_finished
    assert allowed_ids(matcher) == set(tokenizer.eos_ids)


def test_forced_text_is_the_whole_text_the_grammar_allows_next(factories, tokenizers) -> None:
    """What a forced call allows next and nothing else, as tokens: its tag by id, then the text up to the first
    choice, with the token that could join what follows (the `":"` after a key) included."""
    factory, tokenizer = factories["qwen35_tagged"], tokenizers["qwen35_tagged"]
    matcher = factory.matcher(factory.tool_call(TOOLS, QWEN_JSON, name="lookup_key"))
    forced = matcher.forced()
    assert forced[0] == TOOL_CALL_ID
    assert tokenizer.decode(forced[1:]) == '\n{"name":"lookup_key","arguments":{"key":"'
    ids = tokenizer.encode(JSON_CALL)
    for token_id in ids[:-1]:
        allowed = allowed_ids(matcher)
        forced = matcher.forced()
        assert not forced or forced[0] in allowed     # never a token the grammar refuses
        matcher.consume(token_id)
    assert matcher.forced() == [TOOL_CALL_END_ID]
    matcher.consume(ids[-1])
    assert matcher.forced() == []                    # an end of turn is forced, but it is not text


@pytest.mark.parametrize("dialect", [QWEN_JSON, QWEN_XML])
def test_tool_call_tag_is_the_single_added_token(factories, tokenizers, dialect: str) -> None:
    factory, tokenizer = factories["qwen35_tagged"], tokenizers["qwen35_tagged"]
    ids = tokenizer.encode(JSON_CALL)
    assert (ids[0], ids[-1]) == (TOOL_CALL_ID, TOOL_CALL_END_ID)
    matcher = factory.matcher(factory.tool_call(TOOLS, dialect))
    # Never spelled out as "<", "tool", ...: the model only ever saw the tag as that one token.
    assert allowed_ids(matcher) == {TOOL_CALL_ID}


@pytest.mark.parametrize("name", ["smollm2", "qwen35", "qwen35_tagged"])
@pytest.mark.parametrize(
    ("text", "call"),
    [
        (XML_CALL, ("add", {"a": 3, "b": -40, "exact": False})),
        (
            XML_TEXT_CALL,
            ("note", {"title": "Two lines </param and <b>", "body": 'first\nsecond {"x": 1}', "tags": ["a", 2]}),
        ),
    ],
)
def test_xml_dialect_call_passes_and_parses(factories, tokenizers, name: str, text: str, call: tuple) -> None:
    factory, tokenizer = factories[name], tokenizers[name]
    matcher = factory.matcher(factory.tool_call(TOOLS, QWEN_XML))
    assert run_text(matcher, tokenizer, text) is None
    assert matcher.is_finished
    assert parse_calls(QWEN_XML, TOOLS, text) == [call]


# --- invalid outputs are masked ------------------------------------------------------------------

@pytest.mark.parametrize("name", ["smollm2", "qwen35"])
@pytest.mark.parametrize(
    "marked",
    [
        # wrong function name
        '<tool_call>\n{"name":"lookup_ke|x","arguments":{"key":"seq-3"}}\n</tool_call>',
        # whitespace inside the compact JSON
        '<tool_call>\n{"name":| "lookup_key","arguments":{"key":"seq-3"}}\n</tool_call>',
        '<tool_call>\n{| "name":"lookup_key","arguments":{"key":"seq-3"}}\n</tool_call>',
        '<tool_call>\n{"name":"lookup_key","arguments":{"key":"seq-3"}| }\n</tool_call>',
        '<tool_call>\n|\n{"name":"lookup_key","arguments":{"key":"seq-3"}}\n</tool_call>',
        # required argument missing
        '<tool_call>\n{"name":"lookup_key","arguments":{|}}\n</tool_call>',
        '<tool_call>\n{"name":"add","arguments":{"a":1|}}\n</tool_call>',
        # undeclared argument; argument of the wrong type
        '<tool_call>\n{"name":"lookup_key","arguments":{"key":"k"|,"extra":1}}\n</tool_call>',
        '<tool_call>\n{"name":"add","arguments":{"a":|"1","b":2}}\n</tool_call>',
        # text before the call; a second call without parallel
        '|Sure! <tool_call>\n{"name":"lookup_key","arguments":{"key":"k"}}\n</tool_call>',
        JSON_CALL + "|\n" + JSON_CALL,
    ],
)
def test_json_dialect_refuses_at_the_mistake(factories, tokenizers, name: str, marked: str) -> None:
    factory = factories[name]
    assert_refused_at_mark(factory, factory.tool_call(TOOLS, QWEN_JSON), tokenizers[name], marked)


@pytest.mark.parametrize("name", ["smollm2", "qwen35"])
@pytest.mark.parametrize(
    "marked",
    [
        "<tool_call>\n<function=lookup|>\n",
        "<tool_call>\n<function=add>\n<parameter=|c>\n1\n</parameter>\n",
        # b is required
        "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<|/function>",
        "<tool_call>\n<function=add>\n<parameter=a>\n|one\n</parameter>\n",
        "<tool_call>\n<function=add>\n<parameter=a>\n| 1\n</parameter>\n",
        # schema order: a before b
        "<tool_call>\n<function=add>\n<parameter=|b>\n1\n</parameter>\n",
        # a raw value ends at its first `</parameter>`, which must follow a newline
        "<tool_call>\n<function=note>\n<parameter=body>\nx</parameter|>\n",
    ],
)
def test_xml_dialect_refuses_at_the_mistake(factories, tokenizers, name: str, marked: str) -> None:
    factory = factories[name]
    assert_refused_at_mark(factory, factory.tool_call(TOOLS, QWEN_XML), tokenizers[name], marked)


@pytest.mark.parametrize("name", ["smollm2", "qwen35"])
def test_function_name_tokens_are_prefixes_of_tool_names(factories, tokenizers, name: str) -> None:
    factory, tokenizer = factories[name], tokenizers[name]
    matcher = factory.matcher(factory.tool_call(TOOLS, QWEN_JSON))
    assert run_text(matcher, tokenizer, '<tool_call>\n{"name":"') is None
    pieces = {tokenizer.token_bytes(i) for i in allowed_ids(matcher)}
    continuations = [f'{tool["function"]["name"]}","arguments":{{'.encode() for tool in TOOLS]
    assert all(any(c.startswith(piece) for c in continuations) for piece in pieces)
    assert {piece[:1] for piece in pieces} == {b"l", b"a", b"n"}


@pytest.mark.parametrize("name", ["smollm2", "qwen35"])
def test_padding_and_special_ids_never_allowed_inside_text(factories, tokenizers, name: str) -> None:
    factory, tokenizer = factories[name], tokenizers[name]
    matcher = factory.matcher(factory.tool_call(TOOLS, QWEN_XML))
    assert run_text(matcher, tokenizer, "<tool_call>\n<function=note>\n<parameter=body>\nfree ") is None
    allowed = matcher.allowed_mask()
    assert allowed.sum() > 0.9 * tokenizer.vocab_size
    assert not allowed[sorted(tokenizer.special_ids)].any()
    if name == "qwen35":
        # The vocab ends in `[PAD151646]`... entries, added tokens that are never text.
        assert tokenizer.id_to_piece(151646) == "[PAD151646]"
        assert not allowed[151646:].any()
    logits = np.zeros(factory.vocab_size + LOGITS_PADDING, dtype=np.float32)
    matcher.apply(logits)
    assert np.all(logits[factory.vocab_size :] == -np.inf)


@pytest.mark.parametrize("name", ["smollm2", "qwen35", "qwen35_tagged"])
def test_no_tool_call_allows_any_text_but_a_call_opening(factories, tokenizers, name: str) -> None:
    """tool_choice "none": any text, ended anywhere, but never the open tag (as text or as its added token)."""
    factory, tokenizer = factories[name], tokenizers[name]
    grammar = factory.no_tool_call()
    text = "Compare a <tool_cal> b, <tool_call without its bracket, tool_call> and </tool_call>.\n"
    matcher = factory.matcher(grammar)
    assert run_text(matcher, tokenizer, text) is None
    assert set(tokenizer.eos_ids) <= allowed_ids(matcher)
    assert_refused_at_mark(factory, grammar, tokenizer, f"{text}Now: <tool_call|>")
    if name == "qwen35_tagged":
        # Added tokens other than the tag's (a template's thinking tags) may come anywhere between texts.
        assert {THINK_ID, THINK_END_ID} <= allowed_ids(factory.matcher(grammar))
        assert TOOL_CALL_ID not in allowed_ids(factory.matcher(grammar))
        thinking = "<think>\nA plan <tool_\n</think>\n\ncall> is text.</think>"
        assert tokenizer.encode(thinking).count(THINK_END_ID) == 2
        assert run_text(factory.matcher(grammar), tokenizer, thinking) is None
        assert_refused_at_mark(factory, grammar, tokenizer, "<think>\nNo.\n</think>\n\n<tool_call|>")


def test_no_tool_call_takes_thousands_of_added_tokens(smollm2_tokenizer_object: dict) -> None:
    """Gemma 3 has 6,319 special added tokens: all may come between texts, and the grammar still parses (as
    alternatives they overflowed llguidance's items per parser row)."""
    pieces = smollm2_tokenizer_object["tokenizer.ggml.tokens"]
    added = [token_id for token_id in range(30_000, len(pieces)) if pieces[token_id].isascii()][-3000:]
    types = list(smollm2_tokenizer_object["tokenizer.ggml.token_type"])
    for token_id in added:
        types[token_id] = TOKEN_TYPE_CONTROL
    tokenizer = Tokenizer.from_object({**smollm2_tokenizer_object, "tokenizer.ggml.token_type": types})
    factory = GrammarFactory(tokenizer)
    matcher = factory.matcher(factory.no_tool_call())
    assert run_text(matcher, tokenizer, "Some text, then ") is None
    assert set(added) <= allowed_ids(matcher)
    matcher.consume(added[-1])
    assert run_text(matcher, tokenizer, " and more text.") is None


# --- random models terminate with valid output ---------------------------------------------------

@pytest.mark.parametrize("name", ["smollm2", "qwen35"])
@pytest.mark.parametrize("seed", SEEDS)
def test_random_model_json_dialect_call(factories, tokenizers, name: str, seed: int) -> None:
    factory, tokenizer = factories[name], tokenizers[name]
    text = random_generation(factory, factory.tool_call(RANDOM_JSON_TOOLS, QWEN_JSON), tokenizer, seed)
    assert text.startswith('<tool_call>\n{"name":"') and text.endswith("}\n</tool_call>")
    body = json.loads(text[len("<tool_call>\n") : -len("\n</tool_call>")])
    assert list(body) == ["name", "arguments"]
    check_arguments(body["name"], body["arguments"])
    assert parse_calls(QWEN_JSON, RANDOM_JSON_TOOLS, text) == [(body["name"], body["arguments"])]


@pytest.mark.parametrize("name", ["smollm2", "qwen35"])
@pytest.mark.parametrize("seed", SEEDS)
def test_random_model_xml_dialect_call(factories, tokenizers, name: str, seed: int) -> None:
    factory, tokenizer = factories[name], tokenizers[name]
    text = random_generation(factory, factory.tool_call(RANDOM_XML_TOOLS, QWEN_XML), tokenizer, seed)
    calls = parse_calls(QWEN_XML, RANDOM_XML_TOOLS, text)
    assert len(calls) == 1
    check_arguments(*calls[0])


@pytest.mark.parametrize("name", ["smollm2", "qwen35"])
@pytest.mark.parametrize("seed", SEEDS)
def test_random_model_json_schema(factories, tokenizers, name: str, seed: int) -> None:
    factory, tokenizer = factories[name], tokenizers[name]
    text = random_generation(factory, factory.json_schema(ORDER_SCHEMA), tokenizer, seed)
    document = json.loads(text)
    check_order(document)
    # Compact: exactly the tightest serialisation of its own value.
    assert text == json.dumps(document, separators=(",", ":"), ensure_ascii=False)


# --- json_schema / json_object ------------------------------------------------------------------

@pytest.mark.parametrize("name", ["smollm2", "qwen35"])
def test_json_schema_accepts_a_valid_document_then_only_eos(factories, tokenizers, name: str) -> None:
    factory, tokenizer = factories[name], tokenizers[name]
    matcher = factory.matcher(factory.json_schema(ORDER_SCHEMA))
    assert run_text(matcher, tokenizer, ORDER) is None
    assert matcher.is_finished
    assert allowed_ids(matcher) == set(tokenizer.eos_ids)


@pytest.mark.parametrize("name", ["smollm2", "qwen35"])
@pytest.mark.parametrize(
    ("old", "new"),
    [
        ('"status":"paid"', '"status":"|lost"'),
        ('"id":7', '"id":|0'),
        ('"id":7', '"id":|"7"'),
        ('"vip":true', '"vip":|1'),
        ('"qty":2', '"qty":10|0'),
        ('"sku":"A1"', '"sku":"|C3"'),
        ('"id":7,"status"', '"id":7,| "status"'),
        ('"items":[', '"items":| ['),
        ('"items":[{"sku":"A1","qty":2},{"sku":"B2","qty":1}]', '"items":[|]'),
        ('{"sku":"B2","qty":1}]', '{"sku":"B2","qty":1},{"sku":"B2","qty":1}|,{"sku":"B2","qty":1}]'),
        ('"vip":true}', '"vip":true|,"age":3}'),
    ],
)
def test_json_schema_refuses_at_the_mistake(factories, tokenizers, name: str, old: str, new: str) -> None:
    factory = factories[name]
    marked = ORDER.replace(old, new)
    assert marked != ORDER
    assert_refused_at_mark(factory, factory.json_schema(ORDER_SCHEMA), tokenizers[name], marked)


@pytest.mark.parametrize("marked", ["|[1]", '| {"a":1}', '{"a":| 1}', '{"a":1|\n}'])
def test_json_object_is_one_compact_object(factories, tokenizers, marked: str) -> None:
    factory, tokenizer = factories["smollm2"], tokenizers["smollm2"]
    grammar = factory.json_object()
    matcher = factory.matcher(grammar)
    assert run_text(matcher, tokenizer, '{"a":[1,{"b":null}],"c":"x y"}') is None
    assert matcher.is_finished
    assert_refused_at_mark(factory, grammar, tokenizer, marked)


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "nonsense"}, "Invalid type: nonsense"),
        ({"properties": {"a": {"$ref": "#/$defs/missing"}}}, "Pointer '/$defs/missing' does not exist"),
        ({"type": "integer", "minimum": 5, "maximum": 2},
         "Unsatisfiable schema: minimum (5) is greater than maximum (2)"),
        ({"type": "string", "format": "no-such-format"}, "Unknown format: no-such-format"),
        (["not", "an", "object"], "a JSON schema must be an object, got list"),
    ],
)
def test_invalid_schema_fails_at_construction(factories, schema: object, message: str) -> None:
    with pytest.raises(GrammarError) as info:
        factories["smollm2"].json_schema(schema)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("tools", "dialect", "name", "message"),
    [
        (TOOLS, QWEN_JSON, "missing", "tool 'missing' is not among the tools"),
        (TOOLS, "yaml", None, "unknown tool-call dialect 'yaml'"),
        ([], QWEN_JSON, None, "a forced tool call needs at least one tool"),
        ([{"type": "function"}], QWEN_JSON, None, "each tool must be {'type': 'function', 'function': {'name': ...}}"),
        (
            [LOOKUP, function("f", {"n": {"type": "integer", "minimum": 3, "maximum": 1}}, [])],
            QWEN_XML,
            None,
            "parameters of tool 'f': Unsatisfiable schema: minimum (3) is greater than maximum (1)",
        ),
        (
            [function("g", {"n": {"type": "string", "minLength": 3, "maxLength": 1}}, ["n"]), LOOKUP],
            QWEN_JSON,
            None,
            "parameters of tool 'g': Unsatisfiable schema: required property 'arguments' is unsatisfiable",
        ),
    ],
)
def test_invalid_tool_request_fails_at_construction(factories, tools, dialect: str, name, message: str) -> None:
    with pytest.raises(GrammarError) as info:
        factories["smollm2"].tool_call(tools, dialect, name=name)
    assert str(info.value) == message


def test_tool_schemas_ignore_unimplemented_keywords(factories) -> None:
    # A response_format schema with an unknown format is refused; tools, sent with every request, are not.
    uri = function("fetch", {"url": {"type": "string", "format": "uri-reference"}}, ["url"])
    with pytest.raises(GrammarError):
        factories["smollm2"].json_schema(uri["function"]["parameters"])
    for dialect in (QWEN_JSON, QWEN_XML):
        factories["smollm2"].tool_call([uri], dialect)


@pytest.mark.parametrize("dialect", [QWEN_JSON, QWEN_XML])
def test_tool_schema_refs_resolve_against_its_parameters(factories, tokenizers, dialect: str) -> None:
    factory, tokenizer = factories["smollm2"], tokenizers["smollm2"]
    parameters = {
        "type": "object",
        "$defs": {"Level": {"type": "integer", "minimum": 1, "maximum": 3}},
        "properties": {"level": {"type": "integer", "$ref": "#/$defs/Level"}},
        "required": ["level"],
    }
    grammar = factory.tool_call([{"type": "function", "function": {"name": "set", "parameters": parameters}}], dialect)
    ok, bad = {
        QWEN_JSON: (
            '<tool_call>\n{"name":"set","arguments":{"level":2}}\n</tool_call>',
            '<tool_call>\n{"name":"set","arguments":{"level":|4}}\n</tool_call>',
        ),
        QWEN_XML: (
            "<tool_call>\n<function=set>\n<parameter=level>\n2\n</parameter>\n</function>\n</tool_call>",
            "<tool_call>\n<function=set>\n<parameter=level>\n|4\n</parameter>\n</function>\n</tool_call>",
        ),
    }[dialect]
    assert run_text(factory.matcher(grammar), tokenizer, ok) is None
    assert_refused_at_mark(factory, grammar, tokenizer, bad)


# --- named function, parallel calls --------------------------------------------------------------

@pytest.mark.parametrize("name", ["smollm2", "qwen35_tagged"])
def test_named_function_is_the_only_one(factories, tokenizers, name: str) -> None:
    factory, tokenizer = factories[name], tokenizers[name]
    json_grammar = factory.tool_call(TOOLS, QWEN_JSON, name="add")
    add_call = '<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call>'
    assert run_text(factory.matcher(json_grammar), tokenizer, add_call) is None
    assert_refused_at_mark(factory, json_grammar, tokenizer, JSON_CALL.replace('"lookup', '"|lookup'))
    xml_grammar = factory.tool_call(TOOLS, QWEN_XML, name="add")
    assert run_text(factory.matcher(xml_grammar), tokenizer, XML_CALL) is None
    assert_refused_at_mark(factory, xml_grammar, tokenizer, XML_TEXT_CALL.replace("=note", "=|note"))


@pytest.mark.parametrize("name", ["smollm2", "qwen35_tagged"])
@pytest.mark.parametrize(
    ("dialect", "first", "second"),
    [
        (QWEN_JSON, JSON_CALL, '<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call>'),
        (QWEN_XML, XML_CALL, XML_TEXT_CALL),
    ],
)
def test_parallel_allows_calls_up_to_the_limit(factories, tokenizers, name: str, dialect: str, first: str,
                                               second: str) -> None:
    factory, tokenizer = factories[name], tokenizers[name]
    matcher = factory.matcher(factory.tool_call(TOOLS, dialect, max_calls=3))
    assert run_text(matcher, tokenizer, first) is None
    # Complete, but another call may follow: the engine ends when the model picks EOS.
    assert not matcher.is_finished
    allowed = allowed_ids(matcher)
    assert set(tokenizer.eos_ids) < allowed
    assert tokenizer.encode("\n")[0] in allowed
    assert run_text(matcher, tokenizer, "\n" + second) is None
    assert not matcher.is_finished
    assert set(tokenizer.eos_ids) < allowed_ids(matcher)
    assert len(parse_calls(dialect, TOOLS, first + "\n" + second)) == 2
    # The third call is the last one allowed: then only the end.
    assert run_text(matcher, tokenizer, "\n" + first) is None
    assert tokenizer.encode("\n")[0] not in allowed_ids(matcher)


# --- the matcher ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["smollm2", "qwen35"])
@pytest.mark.parametrize("prefix", ["", '<tool_call>\n{"name":"lookup_key","arguments":{"key":"a '])
def test_apply_masks_exactly_the_disallowed_ids(factories, tokenizers, name: str, prefix: str) -> None:
    factory, tokenizer = factories[name], tokenizers[name]
    matcher = factory.matcher(factory.tool_call(TOOLS, QWEN_JSON))
    assert run_text(matcher, tokenizer, prefix) is None
    width = factory.vocab_size + LOGITS_PADDING
    allowed = matcher.allowed_mask(np.ones(width, dtype=np.bool_))
    assert not allowed[factory.vocab_size :].any()
    np.testing.assert_array_equal(allowed[: factory.vocab_size], matcher.allowed_mask())
    assert 0 < allowed.sum() < factory.vocab_size
    original = np.random.default_rng(1).standard_normal(width).astype(np.float32)
    logits = original.copy()
    matcher.apply(logits)
    np.testing.assert_array_equal(logits, np.where(allowed, original, -np.inf))


def test_consume_refuses_a_disallowed_token_and_reset_starts_over(factories, tokenizers) -> None:
    factory, tokenizer = factories["smollm2"], tokenizers["smollm2"]
    matcher = factory.matcher(factory.json_schema(ORDER_SCHEMA))
    start = matcher.allowed_mask()
    assert {tokenizer.token_bytes(i) for i in np.flatnonzero(start)} <= {b"{", b'{"', b'{"id', b'{"id"', b'{"id":'}
    bracket = tokenizer.encode("[")[0]
    with pytest.raises(GrammarError, match=f"^token {bracket} is not allowed here"):
        matcher.consume(bracket)
    matcher.reset()
    np.testing.assert_array_equal(matcher.allowed_mask(), start)
    assert run_text(matcher, tokenizer, ORDER) is None
    assert matcher.is_finished


def test_matchers_of_one_grammar_are_independent(factories, tokenizers) -> None:
    factory, tokenizer = factories["smollm2"], tokenizers["smollm2"]
    grammar = factory.tool_call(TOOLS, QWEN_JSON)
    first, second = factory.matcher(grammar), factory.matcher(grammar)
    assert run_text(first, tokenizer, JSON_CALL) is None
    assert first.is_finished and not second.is_finished
    assert run_text(second, tokenizer, JSON_CALL) is None
    assert second.is_finished
