"""Grammar-constrained decoding with llguidance: JSON schemas and forced tool calls as masks over the vocabulary.

One `GrammarFactory` per model compiles constraints; one `GrammarMatcher` per request and choice masks
each logits row and follows the sampled tokens.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np
from llguidance import LLMatcher, LLParserLimits, LLTokenizer
from llguidance.gbnf_to_lark import gbnf_to_lark

from basert.chat.tool_calls import CLOSE_TAG, OPEN_TAG, QWEN_JSON, QWEN_XML
from basert.errors import InvalidRequestError
from basert.tokenizer import Tokenizer

# Compact JSON: a structure leaves no room for whitespace, so a weak model cannot loop on it.
COMPACT = {"whitespace_flexible": False}
# Tool schemas come with every request and often carry keywords (formats, annotations) llguidance does not
# implement; a forced call should ignore those rather than fail. A response_format schema is enforced strictly.
COMPACT_LENIENT = {"whitespace_flexible": False, "lenient": True}
# Short errors: the default embeds the parser state and the whole grammar in every message.
LIMITS = LLParserLimits(verbose_errors=False)
XML_CLOSE_VALUE = "\n</parameter>\n"
TEXT_VALUE = "TEXT_VALUE"
# JSON-schema types that the XML dialect writes as JSON text; any other parameter is raw text.
XML_JSON_TYPES = frozenset({"integer", "number", "boolean", "null", "object", "array"})
DEFINITION_KEYS = ("$defs", "definitions")
# How llguidance writes a special token among forced bytes.
SPECIAL_IN_BYTES = re.compile(rb"\xff\[(\d+)\]")
# GGUF converters fill the ids between the tokenizer's vocabulary and the model's embedding rows with these.
PAD_PIECE = re.compile(r"\[PAD\d+\]")
# Row b holds, for the 8 token ids that byte b of a bitmask covers, the ceiling each logit gets: +inf keeps
# it (min(x, +inf) == x), -inf masks it. Masking is then one gather and one minimum, with no branches.
BYTE_CEILINGS = np.where((np.arange(256)[:, None] >> np.arange(8)) & 1, np.inf, -np.inf).astype(np.float32)


class GrammarError(InvalidRequestError, ValueError):
    """A schema, tool list or grammar that cannot be enforced; raised when the constraint is built."""


@dataclass(frozen=True, slots=True)
class Grammar:
    """A constraint compiled for one model's vocabulary; every choice of a request starts from a copy."""

    initial: LLMatcher


class GrammarFactory:
    """Compiles constraints against one model's vocabulary (built once per model: about a second)."""

    __slots__ = ("_lltokenizer", "_no_call", "_specials", "_tokenizer", "_usable", "vocab_size")

    def __init__(self, tokenizer: Tokenizer) -> None:
        # The first EOS id is the one llguidance names; every turn end ends a complete output.
        eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
        eos += sorted(tokenizer.eos_ids - set(eos))
        hf_json = tokenizer.to_hf_json()
        self._tokenizer = tokenizer
        self._lltokenizer = LLTokenizer(hf_json, eos_token=eos or None)
        self.vocab_size: int = self._lltokenizer.vocab_size
        # One bit per id, clear for padding entries: llguidance would take `[PAD151646]` for plain text.
        self._usable = np.full((self.vocab_size + 31) // 32, -1, dtype=np.int32)
        usable_bits = np.unpackbits(self._usable.view(np.uint8), bitorder="little")
        hf = json.loads(hf_json)
        padding = _padding_ids(hf)
        usable_bits[padding] = 0
        self._usable.view(np.uint8)[:] = np.packbits(usable_bits, bitorder="little")
        # Added tokens llguidance matches only by id (never as their text), end-of-turn and padding ones aside.
        ends = set(eos) | set(padding)
        self._specials = sorted({token["id"] for token in hf.get("added_tokens", [])
                                 if token["id"] not in ends and self._lltokenizer.is_special_token(token["id"])})
        self._no_call: Grammar | None = None

    def json_schema(self, schema: dict) -> Grammar:
        """Output one compact JSON value matching `schema` (response_format json_schema)."""
        if not isinstance(schema, dict):
            raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
        try:
            source = LLMatcher.grammar_from_json_schema(schema, overrides=COMPACT)
        except ValueError as error:
            raise GrammarError(f"invalid JSON schema: {error}") from None
        return self._compile(source)

    def json_object(self) -> Grammar:
        """Output one compact JSON object of any shape (response_format json_object)."""
        return self.json_schema({"type": "object"})

    def gbnf(self, source: str) -> Grammar:
        """Output matching a GBNF grammar (llama.cpp's `grammar` field), through llguidance's Lark translation."""
        if not isinstance(source, str) or not source.strip():
            raise GrammarError("a grammar must be non-empty GBNF text")
        try:
            lark = gbnf_to_lark(source)
        except Exception as error:  # the translator raises its own error types and plain ValueErrors
            raise GrammarError(f"invalid GBNF grammar: {_first_line(str(error))}") from None
        return self._compile(LLMatcher.grammar_from_lark(lark))

    def tool_call(self, tools: list[dict], dialect: str, *, name: str | None = None, max_calls: int = 1) -> Grammar:
        """Output one to `max_calls` tool calls in the model's dialect, then end."""
        functions = _functions(tools)
        if name is not None:
            functions = [f for f in functions if f["name"] == name]
            if not functions:
                raise GrammarError(f"tool {name!r} is not among the tools")
        # (tool name, JSON schema document) of each %json in the grammar, to name the culprit of an error.
        documents: list[tuple[str, dict]] = []
        if dialect == QWEN_JSON:
            rules = self._json_dialect(functions, documents)
        elif dialect == QWEN_XML:
            rules = self._xml_dialect(functions, documents)
        else:
            raise GrammarError(f"unknown tool-call dialect {dialect!r}")
        start = f'start: call ("\\n" call){{0,{max_calls - 1}}}' if max_calls > 1 else "start: call"
        call = f'call: {self._literal(OPEN_TAG)} "\\n" body "\\n" {self._literal(CLOSE_TAG)}'
        try:
            return self._compile(LLMatcher.grammar_from_lark("\n".join([start, call, *rules])))
        except GrammarError as error:
            raise self._tool_error(documents, error) from None

    def no_tool_call(self) -> Grammar:
        """Any output that never opens a tool call (`tool_choice` "none" with the tools in the prompt)."""
        if self._no_call is None:
            # The text may not hold the open tag; added tokens (a template's `<think>`, say) may come between
            # texts, except those the tag is made of. TEXTs never meet, so the tag cannot span two of them.
            opening = set(self._tokenizer.encode(OPEN_TAG))
            specials = _id_ranges([token_id for token_id in self._specials if token_id not in opening])
            rules = ["start: TEXT? (special TEXT?)*", f"special: <[{specials}]>"] if specials else ["start: TEXT?"]
            rules.append(f"TEXT: /(?s:.+)/ & ~/(?s:.*){re.escape(OPEN_TAG)}(?s:.*)/")
            self._no_call = self._compile(LLMatcher.grammar_from_lark("\n".join(rules)))
        return self._no_call

    def matcher(self, grammar: Grammar) -> GrammarMatcher:
        """A fresh matcher at the start of `grammar`, for one choice of one request."""
        return GrammarMatcher(grammar, self._usable, self.vocab_size, self._tokenizer)

    def _compile(self, source: str) -> Grammar:
        matcher = LLMatcher(self._lltokenizer, source, log_level=0, limits=LIMITS)
        if matcher.is_error():
            raise GrammarError(_first_line(matcher.get_error()))
        return Grammar(matcher)

    def _tool_error(self, documents: list[tuple[str, dict]], error: GrammarError) -> GrammarError:
        """The error of the first tool whose schema fails alone, else the grammar's own."""
        for name, document in documents:
            message = LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(document), self._lltokenizer)
            if message:
                return GrammarError(f"parameters of tool {name!r}: {_first_line(message)}")
        return error

    def _literal(self, text: str) -> str:
        """Lark for fixed text, naming as token ids the added tokens the tokenizer splits it into."""
        # llguidance takes added tokens such as Qwen's `<tool_call>` for special ones: they match only as
        # `<[id]>`, never as the text they stand for, and the model only ever saw them as that one token.
        parts: list[str] = []
        pending = b""
        for token_id in self._tokenizer.encode(text):
            if self._lltokenizer.is_special_token(token_id):
                if pending:
                    parts.append(_lark_string(pending.decode("utf-8")))
                    pending = b""
                parts.append(f"<[{token_id}]>")
            else:
                pending += self._tokenizer.token_bytes(token_id)
        if pending:
            parts.append(_lark_string(pending.decode("utf-8")))
        return " ".join(parts)

    def _json_dialect(self, functions: list[dict], documents: list[tuple[str, dict]]) -> list[str]:
        # One JSON document per function so each keeps its own `$defs` for `#/$defs/...` references.
        rules = ["body: " + " | ".join(f"fn{i}" for i in range(len(functions)))]
        for i, function in enumerate(functions):
            arguments = _closed(function["parameters"])
            schema = {
                "x-guidance": COMPACT_LENIENT,
                "type": "object",
                "properties": {"name": {"const": function["name"]}, "arguments": arguments},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            _hoist_definitions(schema, arguments)
            documents.append((function["name"], schema))
            rules.append(f"fn{i}: %json {json.dumps(schema)}")
        return rules

    def _xml_dialect(self, functions: list[dict], documents: list[tuple[str, dict]]) -> list[str]:
        rules = ["body: " + " | ".join(f"fn{i}" for i in range(len(functions)))]
        for i, function in enumerate(functions):
            parameters = function["parameters"]
            properties = parameters.get("properties")
            properties = properties if isinstance(properties, dict) else {}
            required = parameters.get("required")
            required = [n for n in required if isinstance(n, str)] if isinstance(required, list) else []
            names = [*properties, *(n for n in required if n not in properties)]
            items = [self._literal(f"<function={function['name']}>\n")]
            for j, param in enumerate(names):
                rule = f"fn{i}_p{j}"
                items.append(rule if param in required else f"{rule}?")
                head = self._literal(f"<parameter={param}>\n")
                schema = properties.get(param)
                schema = schema if isinstance(schema, dict) else {}
                document = _xml_json_document(schema, parameters)
                if document is None:
                    value = self._xml_text_value(schema, f"{rule}_value", rules)
                else:
                    documents.append((function["name"], document))
                    rules.append(f"{rule}_value: %json {json.dumps(document)}")
                    value = f"{rule}_value {self._literal(XML_CLOSE_VALUE)}"
                rules.append(f"{rule}: {head} {value}")
            items.append(self._literal("</function>"))
            rules.append(f"fn{i}: " + " ".join(items))
        if any(TEXT_VALUE in rule for rule in rules):
            # Raw text up to the first `</parameter>`, as the parser reads it; the tag must follow a newline.
            # Not bounded by minLength/maxLength: a counted `(?s:.){m,n}` costs milliseconds per token to
            # mask and exceeds llguidance's lexer limits once combined with the exclusion.
            rules.append(f"{TEXT_VALUE}: /(?s:.*)\\n<\\/parameter>/ & ~/(?s:.*)<\\/parameter>(?s:.+)/")
        return rules

    def _xml_text_value(self, schema: dict, rule: str, rules: list[str]) -> str:
        """Lark for a raw-text parameter value and the newline after its closing tag."""
        choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
        if isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices):
            rules.append(f"{rule}: " + " | ".join(self._literal(c) for c in choices))
            return f"{rule} {self._literal(XML_CLOSE_VALUE)}"
        return f'{TEXT_VALUE} "\\n"'


class GrammarMatcher:
    """One choice's position in a grammar: which tokens may come next, advanced by each sampled token."""

    __slots__ = ("_bitmask", "_ceilings", "_grammar", "_mask_ready", "_matcher", "_tokenizer", "_usable", "vocab_size")

    def __init__(self, grammar: Grammar, usable: np.ndarray, vocab_size: int, tokenizer: Tokenizer) -> None:
        self._grammar = grammar
        self._tokenizer = tokenizer
        self._matcher = grammar.initial.deep_copy()
        self._usable = usable
        self.vocab_size = vocab_size
        self._bitmask = np.zeros_like(usable)
        self._ceilings = np.empty((self._bitmask.nbytes, 8), dtype=np.float32)
        self._mask_ready = False

    def allowed_mask(self, out: np.ndarray | None = None) -> np.ndarray:
        """Bool per token id (over `out`'s length, default the vocabulary): True where the token may come next."""
        bits = self._bits()
        if out is None:
            return np.unpackbits(bits, count=self.vocab_size, bitorder="little").view(np.bool_)
        n = min(len(out), self.vocab_size)
        out[:n] = np.unpackbits(bits, count=n, bitorder="little").view(np.bool_)
        out[n:] = False
        return out

    def apply(self, logits: np.ndarray) -> None:
        """Set the logit of every token that may not come next to -inf, in place; ids past the vocabulary too."""
        n = min(logits.shape[-1], self.vocab_size)
        np.take(BYTE_CEILINGS, self._bits(), axis=0, out=self._ceilings)
        np.minimum(logits[..., :n], self._ceilings.reshape(-1)[:n], out=logits[..., :n])
        logits[..., n:] = -np.inf

    def consume(self, token_id: int) -> None:
        """Advance past a sampled token; GrammarError if the grammar does not allow it here."""
        self._mask_ready = False
        if not self._matcher.consume_token(token_id):
            raise GrammarError(f"token {token_id} is not allowed here: {_first_line(self._matcher.get_error())}")

    def forced(self) -> list[int]:
        """The tokens of the text the grammar allows next and nothing else, as the tokenizer writes that text alone
        (the model may still write it in other tokens, or join its last token to the text after it); empty when the
        next text is not forced. The whole forced text: llguidance's forced tokens stop before a token that could
        join what follows, such as the `":"` after a key, which the model writes as one token all the same."""
        tokens: list[int] = []
        # Special tokens come as b"\xff[id]" among the forced bytes.
        for index, part in enumerate(SPECIAL_IN_BYTES.split(self._matcher.compute_ff_bytes())):
            if index % 2:
                tokens.append(int(part))
            elif part:
                tokens += self._tokenizer.encode(part.decode("utf-8", errors="ignore"), parse_special=False)
        return tokens

    @property
    def is_finished(self) -> bool:
        """True once the output is complete and the grammar allows nothing more than EOS."""
        return self._matcher.is_stopped() and self._matcher.is_accepting()

    def reset(self) -> None:
        """Go back to the start of the grammar, also after a refused token."""
        # A fresh copy: llguidance's own reset() keeps the error state a refused token leaves.
        self._matcher = self._grammar.initial.deep_copy()
        self._mask_ready = False

    def _bits(self) -> np.ndarray:
        # The mask, one bit per token id, as bytes in id order; computed once per position.
        if not self._mask_ready:
            self._matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
            np.bitwise_and(self._bitmask, self._usable, out=self._bitmask)
            self._mask_ready = True
        return self._bitmask.view(np.uint8)


def _functions(tools: list[dict]) -> list[dict]:
    """Each OpenAI tool's function as {"name", "parameters"}, checked."""
    functions = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise GrammarError("each tool must be {'type': 'function', 'function': {'name': ...}}")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise GrammarError(f"parameters of tool {function['name']!r} must be a JSON schema object")
        functions.append({"name": function["name"], "parameters": parameters})
    if not functions:
        raise GrammarError("a forced tool call needs at least one tool")
    return functions


def _closed(parameters: dict) -> dict:
    """The arguments schema, limited to the declared parameters unless it says otherwise."""
    # As in the XML dialect and OpenAI's strict mode: undeclared keys would only give a weak model
    # room to write unbounded names and values.
    return {**parameters, "additionalProperties": parameters.get("additionalProperties", False)}


def _xml_json_document(schema: dict, parameters: dict) -> dict | None:
    """The JSON schema document of an XML parameter written as JSON text, or None for a raw-text one."""
    # The same rule as the XML parser's coercion: JSON for these declared types unless string is among them.
    declared = schema.get("type")
    types = set(declared) if isinstance(declared, list) else {declared}
    if not types & XML_JSON_TYPES or "string" in types:
        return None
    document = {**schema, "x-guidance": COMPACT_LENIENT}
    _hoist_definitions(document, parameters)
    return document


def _hoist_definitions(document: dict, root: dict) -> None:
    """Copy `root`'s `$defs`/`definitions` to `document`, where its `#/$defs/...` references now resolve."""
    for key in DEFINITION_KEYS:
        if key in root:
            document[key] = root[key]


def _padding_ids(hf: dict) -> list[int]:
    """Ids whose vocabulary entry (regular or added) is a `[PAD<n>]` filler."""
    vocab = hf["model"].get("vocab") or {}
    # BPE and WordPiece map piece -> id; Unigram lists [piece, score] in id order.
    pieces = list(vocab.items()) if isinstance(vocab, dict) else [(entry[0], i) for i, entry in enumerate(vocab)]
    pieces += [(token["content"], token["id"]) for token in hf.get("added_tokens", [])]
    return sorted({token_id for piece, token_id in pieces if PAD_PIECE.fullmatch(piece)})


def _id_ranges(ids: list[int]) -> str:
    """Sorted token ids as llguidance's id set `1,3,7-9`: one terminal however many ids (Gemma 3 has 6,319 added
    tokens; as alternatives they would exceed the parser's items per row)."""
    runs: list[list[int]] = []
    for token_id in ids:
        if runs and token_id == runs[-1][1] + 1:
            runs[-1][1] = token_id
        else:
            runs.append([token_id, token_id])
    return ",".join(str(first) if first == last else f"{first}-{last}" for first, last in runs)


def _first_line(message: str) -> str:
    # llguidance appends parser state or the grammar's listing on further lines. A first line that ends in
    # ":" ("regex parse error:") announces its detail on the next few lines: keep those, on one line.
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return message
    kept = lines[:1]
    if kept[0].endswith(":"):
        kept += lines[1:4]
    return " ".join(kept)[:300]


def _lark_string(text: str) -> str:
    # A JSON string literal is a valid lark string literal (llguidance reads the same escapes).
    return json.dumps(text)
