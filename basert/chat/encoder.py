"""Tokenizes one chat request so that only the chat template writes control tokens.

Special-token text inside the request's strings is swapped for markers before rendering, and becomes plain
text again when the rendered prompt is tokenized.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

from basert.tokenizer import Tokenizer


class ChatEncoder:
    """One request's markers, and the tokenization of the prompt rendered from the strings that hold them."""

    __slots__ = ("_tokenizer", "_nonce", "_marker", "_texts")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        # Private-use characters around a random nonce: no request can write a marker of its own, and
        # templates pass them through unchanged (`tojson` included).
        self._nonce = secrets.token_hex(16)
        self._marker = re.compile(f"\ue000{self._nonce}:(\\d+)\ue001")
        self._texts: list[str] = []

    def hide(self, value: Any) -> Any:
        """A copy of `value` whose strings (dict keys included, at any depth) hold markers for special-token text."""
        if isinstance(value, str):
            return self._tokenizer.special_pattern.sub(self._mark, value)
        if isinstance(value, list):
            return [self.hide(item) for item in value]
        if isinstance(value, dict):
            return {self.hide(key): self.hide(item) for key, item in value.items()}
        return value

    def encode(self, rendered: str) -> list[int]:
        """Token ids of a prompt rendered from hidden strings.

        Special-token text the template wrote becomes control tokens; text the request wrote stays plain.
        """
        tokenizer = self._tokenizer
        if not self._texts:
            # Nothing was hidden, so all special-token text is the template's: one `encode` of the whole prompt,
            # exact even for tokenizers that treat the start of a text specially (Metaspace's prepend "first"),
            # which the stretches below, each encoded as a text of its own, are not.
            return tokenizer.encode(rendered)
        ids: list[int] = []
        start = 0
        for match in tokenizer.special_pattern.finditer(rendered):
            ids += tokenizer.encode(self._restore(rendered[start : match.start()]), parse_special=False)
            ids.append(tokenizer.token_to_id(match.group()))
            start = match.end()
        ids += tokenizer.encode(self._restore(rendered[start:]), parse_special=False)
        return ids

    def _mark(self, match: re.Match[str]) -> str:
        self._texts.append(match.group())
        return f"\ue000{self._nonce}:{len(self._texts) - 1}\ue001"

    def _restore(self, text: str) -> str:
        return self._marker.sub(lambda match: self._texts[int(match.group(1))], text)
