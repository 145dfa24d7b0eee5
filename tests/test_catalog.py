"""Model ids: `org/name` inside the models directory (`name` for files converted on first use), else the file
stem, never a free-text name from the header."""

from __future__ import annotations

from pathlib import Path

import pytest

from basert.engine.build import model_id_for
from basert.models_dir import resolve_model


def test_model_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BASERT_MODELS_DIR", str(tmp_path / "models"))
    installed = tmp_path / "models" / "org" / "name" / "default-q4" / "model.base"
    assert model_id_for(installed) == "org/name"
    converted = tmp_path / "models" / "local" / "smollm2-135m-8k-lc100k-mix1-ep2" / "default" / "model.base"
    assert model_id_for(converted) == "smollm2-135m-8k-lc100k-mix1-ep2"
    assert model_id_for(tmp_path / "a" / "b" / "c" / "model.base") == "model"
    assert model_id_for(tmp_path / "SmolLM2-135M-8k.base") == "SmolLM2-135M-8k"


def test_installed_ids_resolve_by_full_id_or_unique_name(tmp_path: Path) -> None:
    root = tmp_path / "models"
    for model_id in ("org/one", "local/two", "a/three", "b/three"):
        path = root / model_id / "default" / "model.base"
        path.parent.mkdir(parents=True)
        path.write_bytes(b"")
    assert resolve_model("org/one", root) == root / "org/one/default/model.base"
    assert resolve_model("two", root) == root / "local/two/default/model.base"
    assert resolve_model("two:default", root) == root / "local/two/default/model.base"
    with pytest.raises(LookupError, match="'three' is ambiguous: name one of a/three, b/three"):
        resolve_model("three", root)  # two orgs have it: ambiguous
    with pytest.raises(LookupError, match="not found"):
        resolve_model("two:other", root)
