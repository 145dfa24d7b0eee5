"""Model ids: `org/name` inside the models directory, else the header's name or the file stem."""

from __future__ import annotations

from pathlib import Path

import pytest

from basert.engine.build import model_id_for


def test_model_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BASERT_MODELS_DIR", str(tmp_path / "models"))
    installed = tmp_path / "models" / "org" / "name" / "default-q4" / "model.base"
    assert model_id_for(installed, "Header Name") == "org/name"
    elsewhere = tmp_path / "a" / "b" / "c" / "model.base"
    assert model_id_for(elsewhere, "Header Name") == "Header Name"
    assert model_id_for(tmp_path / "tiny.base", None) == "tiny"
