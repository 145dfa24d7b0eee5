"""Shared fixtures: paths to the committed reference data, and models converted once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
TINY_MODELS = ("qwen3-tiny", "qwen3_5-tiny", "qwen3_5_moe-tiny", "qwen3_next-tiny")


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from basert.models_dir import smollm2_gguf_path

    return smollm2_gguf_path()


@pytest.fixture(scope="session")
def qwen35_tokenizer_object(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tokenizer object of the Qwen3.5 vocab-only GGUF (decompressed once per session)."""
    import lzma

    from basert.convert.tokenizer_source import tokenizer_object_from_path

    path = tmp_path_factory.mktemp("vocab") / "ggml-vocab-qwen35.gguf"
    path.write_bytes(lzma.decompress((FIXTURES / "tokenizers" / "ggml-vocab-qwen35.gguf.xz").read_bytes()))
    return tokenizer_object_from_path(path)


@pytest.fixture(scope="session")
def smollm2_tokenizer_object(smollm2_gguf: Path) -> dict:
    import gguf

    from basert.convert.tokenizer_source import tokenizer_object_from_gguf

    return tokenizer_object_from_gguf(gguf.GGUFReader(smollm2_gguf))


@pytest.fixture(scope="session")
def smollm2_base(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path) -> Path:
    """SmolLM2-135M-Instruct converted losslessly from its Q4_1 GGUF."""
    from basert.convert import convert

    out = tmp_path_factory.mktemp("smollm2") / "model.base"
    convert(smollm2_gguf, out)
    return out


@pytest.fixture(scope="session")
def tiny_f32_bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each tiny reference model converted from safetensors with --target f32."""
    from basert.convert import convert

    root = tmp_path_factory.mktemp("tiny")
    bases = {}
    for name in TINY_MODELS:
        out = root / f"{name}.base"
        convert(FIXTURES / "refdata" / "models" / name, out, target="f32")
        bases[name] = out
    return bases
