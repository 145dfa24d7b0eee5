"""A request's prompt as prefix-cache block keys, worked out at the cluster's ingress before a replica is chosen.

The ingress renders and tokenizes a request exactly as a replica's server will (the same chat template, the same
tokenizer, the same `render_chat`), and names its full blocks with the prefix cache's own key chain: the keys
the router compares are the keys the replicas' caches hold. A request that cannot be read here gets no keys
and is routed by load alone; the replica that serves it answers with the proper error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from basert.chat.template import ChatTemplate, model_chat_template
from basert.engine.prefix_cache import chain_keys
from basert.tokenizer import Tokenizer

CHAT_PATHS = frozenset({"/v1/chat/completions", "/chat/completions"})
MESSAGES_PATHS = frozenset({"/v1/messages"})
COMPLETION_PATHS = frozenset({"/v1/completions", "/completions", "/completion"})


@dataclass(frozen=True, slots=True)
class PromptModel:
    """What rendering one served model's prompts takes: names, tokenizer, chat template, fingerprint."""

    names: frozenset[str]
    tokenizer: Tokenizer | None
    template: ChatTemplate | None
    fingerprint: bytes

    @classmethod
    def open(cls, path: Path, *, template_file: Path | None = None, alias: str | None = None) -> PromptModel:
        """Read a .base file's tokenizer and header (not its weights)."""
        from basert._ext.matmul import get_exact
        from basert.engine.build import model_id_for, tokenizer_of
        from basert.engine.runner import engine_fingerprint
        from basert.format.reader import BaseFile

        with BaseFile(path) as base:
            tokenizer = tokenizer_of(base.tokenizer)
        template = model_chat_template(tokenizer, template_file)
        names = {model_id_for(path), path.name, path.stem} | ({alias} if alias else set())
        # The replicas' engines key their prefix caches with their fingerprint: the same path, exact or not, as
        # this process (`--exact` applies to every model a process loads).
        return cls(frozenset(names), tokenizer, template, engine_fingerprint(path, get_exact()).encode())


class PromptKeys:
    """The block keys of requests to the models a cluster serves."""

    def __init__(self, models: list[PromptModel]) -> None:
        if not models:
            raise ValueError("a cluster serves at least one model")
        self.models = models

    def keys(self, path: str, body: bytes) -> tuple[int, ...]:
        """The prompt's block keys; () when the request has no prompt or cannot be read."""
        try:
            payload = json.loads(body) if body else None
        except (ValueError, UnicodeDecodeError):
            return ()
        if not isinstance(payload, dict):
            return ()
        model = self.model_for(payload.get("model"))
        try:
            tokens = self.prompt_tokens(model, path, body, payload)
        except Exception:  # whatever fails here, the replica's server reports to the client
            return ()
        return tuple(chain_keys(tokens, model.fingerprint)) if tokens else ()

    def model_for(self, name: object) -> PromptModel:
        for model in self.models:
            if name in model.names:
                return model
        return self.models[0]   # as a server with one model: any name reaches it

    def prompt_tokens(self, model: PromptModel, path: str, body: bytes, payload: dict) -> list[int] | None:
        from basert.server.anthropic_api import generation_request
        from basert.server.anthropic_schemas import MessagesRequest
        from basert.server.chat_api import render_chat
        from basert.server.schemas import ChatCompletionRequest

        if model.tokenizer is None:
            return None
        if path in CHAT_PATHS or path in MESSAGES_PATHS:
            if model.template is None:
                return None
            if path in CHAT_PATHS:
                chat = ChatCompletionRequest.model_validate_json(body)
            else:
                chat = generation_request(MessagesRequest.model_validate_json(body))
            return render_chat(model.template, model.tokenizer, chat).prompt
        if path in COMPLETION_PATHS:
            prompt = payload.get("prompt")
            if isinstance(prompt, str):
                return model.tokenizer.encode(prompt, add_special=True)
            if isinstance(prompt, list) and prompt and all(type(token) is int for token in prompt):
                return prompt
        return None
