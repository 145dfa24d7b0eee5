"""The models a server serves: their facts, aliases, actor, tokenizer, chat template and tool-call dialect."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import trio

from basert.actor.actor import ModelActor
from basert.chat.template import ChatTemplate
from basert.engine.info import ModelInfo
from basert.server.errors import ApiError, not_found
from basert.tokenizer import Tokenizer


@dataclass(slots=True)
class ServedModel:
    info: ModelInfo
    actor: ModelActor
    tokenizer: Tokenizer | None
    template: ChatTemplate | None
    dialect: str
    grammars: object | None = None           # GrammarFactory, built lazily on first constrained request
    aliases: set[str] = field(default_factory=set)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def wants_segment_ends(self) -> bool:
        """Whether requests should say where chat segments end (hybrid models keep their state there)."""
        return self.info.hybrid

    def require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ApiError(400, f"model {self.info.id} has no tokenizer: send token ids to /v1/completions",
                           code="invalid_value")
        return self.tokenizer

    def require_template(self) -> ChatTemplate:
        if self.template is None:
            raise ApiError(400, f"model {self.info.id} has no chat template (start the server with "
                           "--chat-template FILE)", code="invalid_value")
        return self.template

    def grammar_factory(self):
        if self.grammars is None:
            from basert.chat.grammar import GrammarFactory

            self.grammars = GrammarFactory(self.require_tokenizer())
        return self.grammars

    async def ask(self, message_type: Callable, *args):
        """Send an admin message (`message_type(*args, reply)`) to the model's actor and return its reply.

        A reply that is an exception is raised.
        """
        send, receive = trio.open_memory_channel(math.inf)
        await self.actor.mailbox.send(message_type(*args, send))
        async with receive:
            result = await receive.receive()
        if isinstance(result, Exception):
            raise result
        return result


class ModelCatalog:
    def __init__(self) -> None:
        self.models: list[ServedModel] = []

    def add(self, model: ServedModel, alias: str | None = None) -> None:
        """Serve `model`; an `alias` becomes the id it is reported by (its own id still names it)."""
        model.aliases |= {model.info.id, model.info.path.name, model.info.path.stem}
        if alias:
            model.info = replace(model.info, id=alias)
            model.aliases.add(alias)
        self.models.append(model)

    def resolve(self, name: str | None) -> ServedModel:
        """The model a request names. With one model loaded any name (or none) means that model, as with
        llama.cpp's server, so clients that send a fixed name such as "gpt-4o" work unchanged."""
        if len(self.models) == 1:
            return self.models[0]
        if not name:
            raise ApiError(400, "several models are loaded: the request must name one", param="model",
                           code="invalid_value")
        return self.named(name)

    def named(self, name: str) -> ServedModel:
        """The model with this id or alias, else a 404: for a route that looks a model up (GET /v1/models/{id})."""
        for model in self.models:
            if name in model.aliases:
                return model
        raise not_found(f"model {name!r} not found (loaded: {', '.join(m.info.id for m in self.models)})",
                        "model_not_found")
