"""Request bodies as JSON: parsed, then checked for what would break code further in (depth, lone surrogates)."""

from __future__ import annotations

import json

from quart import request

from basert.server.errors import invalid

# Deeper than any real request; deep enough structures would exhaust the stack of recursive code later.
MAX_JSON_DEPTH = 64


def parse_json_object(raw: bytes) -> dict:
    """The JSON object in `raw`, or a 400 for anything else."""
    try:
        body = json.loads(raw or b"null")
    except RecursionError:
        raise invalid(f"request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    check_json_value(body)
    return body


async def request_json() -> dict:
    """The current request's body as a JSON object, or a 400."""
    return parse_json_object(await request.get_data())


async def optional_request_json() -> dict:
    """The current request's body as a JSON object, {} when it has none, or a 400 (a 413 over the body limit)."""
    raw = await request.get_data()
    return parse_json_object(raw) if raw else {}


def check_json_value(value: object) -> None:
    """Refuse nesting beyond MAX_JSON_DEPTH and strings that are not Unicode text (lone surrogates)."""
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            _check_text(item)
        elif isinstance(item, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise invalid(f"request body nests deeper than {MAX_JSON_DEPTH} levels")
            if isinstance(item, dict):
                for key, child in item.items():
                    _check_text(key)
                    stack.append((child, depth + 1))
            else:
                stack.extend((child, depth + 1) for child in item)


def _check_text(text: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid("request body has a string with a lone UTF-16 surrogate (\\ud800-\\udfff), which is "
                      "not text") from None
