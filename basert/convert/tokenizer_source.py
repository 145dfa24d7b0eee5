"""Build the `.base` tokenizer object from a GGUF file's metadata or a Hugging Face model directory."""

from __future__ import annotations

import json
from pathlib import Path

import gguf

from basert.convert.gguf_reader import read_gguf

TOKENIZER_KEY_PREFIX = "tokenizer."


class TokenizerSourceError(ValueError):
    """A tokenizer source is missing or not in a form we can read."""


def tokenizer_object_from_gguf(reader: gguf.GGUFReader) -> dict:
    """Every `tokenizer.*` metadata key of a GGUF file, as plain JSON-ready Python values."""
    obj: dict = {"tokenizer_type": "gguf"}
    for key, field in reader.fields.items():
        if key.startswith(TOKENIZER_KEY_PREFIX):
            obj[key] = field.contents()
    return obj


def tokenizer_object_from_hf(model_dir: Path) -> dict:
    """`tokenizer.json`, `tokenizer_config.json` and the chat template of a Hugging Face model directory."""
    tokenizer_path = model_dir / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise TokenizerSourceError(f"no tokenizer.json in {model_dir}")
    config_path = model_dir / "tokenizer_config.json"
    config = _read_json(config_path) if config_path.is_file() else {}
    obj: dict = {
        "tokenizer_type": "hf",
        "tokenizer.json": _read_json(tokenizer_path),
        "tokenizer_config.json": config,
    }
    template = _chat_template(model_dir, config)
    if template is not None:
        obj["tokenizer.chat_template"] = template
    return obj


def tokenizer_object_from_path(path: Path) -> dict:
    """The tokenizer object of a `.gguf` file, a Hugging Face directory, or its `tokenizer.json`."""
    if path.is_file() and path.suffix.lower() == ".gguf":
        return tokenizer_object_from_gguf(read_gguf(path))
    if path.is_dir():
        return tokenizer_object_from_hf(path)
    if path.is_file() and path.name == "tokenizer.json":
        return tokenizer_object_from_hf(path.parent)
    raise TokenizerSourceError(
        f"{path} is not a .gguf file, a model directory or a tokenizer.json file"
    )


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise TokenizerSourceError(f"{path} is not valid JSON: {error}") from error


def _chat_template(model_dir: Path, config: dict) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        # Older configs list named templates; the unnamed chat one is called "default".
        for entry in template:
            if entry.get("name") == "default":
                return entry["template"]
    jinja_path = model_dir / "chat_template.jinja"
    if jinja_path.is_file():
        return jinja_path.read_text(encoding="utf-8")
    json_path = model_dir / "chat_template.json"
    if json_path.is_file():
        template = _read_json(json_path).get("chat_template")
        if isinstance(template, str):
            return template
    return None
