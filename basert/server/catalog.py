"""The models a server serves: id, aliases, actor, tokenizer, chat template and tool-call dialect."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from basert.actor.actor import ModelActor
from basert.chat.template import ChatTemplate
from basert.server.errors import ApiError, not_found
from basert.tokenizer import Tokenizer


@dataclass(slots=True)
class ServedModel:
    model_id: str
    path: Path
    actor: ModelActor
    tokenizer: Tokenizer | None
    template: ChatTemplate | None
    dialect: str
    grammars: object | None                  # GrammarFactory, built lazily on first constrained request
    n_ctx: int
    aliases: set[str] = field(default_factory=set)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def wants_segment_ends(self) -> bool:
        """Whether requests should say where chat segments end (hybrid models keep their state there)."""
        return self.actor.engine.hybrid

    def require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ApiError(400, f"model {self.model_id} has no tokenizer: send token ids to /v1/completions",
                           code="invalid_value")
        return self.tokenizer

    def require_template(self) -> ChatTemplate:
        if self.template is None:
            raise ApiError(400, f"model {self.model_id} has no chat template (start the server with "
                           "--chat-template FILE)", code="invalid_value")
        return self.template

    def grammar_factory(self):
        if self.grammars is None:
            from basert.chat.grammar import GrammarFactory

            self.grammars = GrammarFactory(self.require_tokenizer())
        return self.grammars


def model_id_for(path: Path, header_name: str | None) -> str:
    """`org/name` for `<models dir>/<org>/<name>/<variant>/model.base`, else the header's name or file stem."""
    from basert.models_dir import MODEL_FILE_NAME, models_dir

    try:
        relative = path.resolve().relative_to(models_dir().resolve())
    except ValueError:
        relative = None
    if relative is not None and len(relative.parts) == 4 and relative.name == MODEL_FILE_NAME:
        return f"{relative.parts[0]}/{relative.parts[1]}"
    return header_name or path.stem


class ModelCatalog:
    def __init__(self) -> None:
        self.models: list[ServedModel] = []

    def add(self, model: ServedModel) -> None:
        model.aliases |= {model.model_id, model.path.name, model.path.stem}
        self.models.append(model)

    def resolve(self, name: str | None) -> ServedModel:
        """The model a request names; with one model loaded the name may be omitted."""
        if not name:
            if len(self.models) == 1:
                return self.models[0]
            raise ApiError(400, "several models are loaded: the request must name one", param="model",
                           code="invalid_value")
        for model in self.models:
            if name in model.aliases:
                return model
        raise not_found(f"model {name!r} not found (loaded: {', '.join(m.model_id for m in self.models)})",
                        "model_not_found")
