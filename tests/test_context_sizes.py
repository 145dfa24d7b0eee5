"""How big a context each slot gets and how big the KV pool is: the model's trained context by default, llama.cpp's
-c as the context over all slots, everything within a memory budget; a context beyond the trained one is served with
one warning (as llama-server serves it); what the memory cannot hold is a one-line start-up error (exit 1) when it
was asked for, and a smaller shared pool when it was a default."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from basert.engine.build import ContextSizeError, EngineOptions, build_engine, context_warning, plan_context
from basert.format import BaseFile
from basert.models import read_config
from basert.testing.launcher import ServerProcess

GIB = 2**30


@pytest.fixture(scope="module")
def smollm2_config(smollm2_base: Path):
    with BaseFile(smollm2_base) as base:
        return read_config(base)


def per_token(config, k: str = "f16", v: str = "f16") -> int:
    """KV bytes of one token: a K row and a V row per kv head of each attention layer."""
    row = {"f32": 4 * config.head_dim, "f16": 2 * config.head_dim, "bf16": 2 * config.head_dim,
           "q8_0": config.head_dim // 32 * 34}
    return config.kv_layers * config.num_key_value_heads * (row[k] + row[v])


def per_window_token(config, k: str = "f16", v: str = "f16") -> int:
    """KV bytes of one token in the sliding-window layers (Gemma 3: 15 of 18 layers)."""
    return per_token(config, k, v) // config.kv_layers * config.window_layers


def plan(config, available: int = 64 * GIB, **fields) -> tuple[int, int]:
    options = EngineOptions(**{"max_context": None, "continuous_batching": True, **fields}).resolved()
    options.check()
    return plan_context(options, config, available)


def test_the_trained_context_by_default_and_c_split_over_the_slots(smollm2_config):
    assert smollm2_config.trained_context == 8192
    assert plan(smollm2_config, n_slots=4) == (8192, 4 * 8192)
    assert plan(smollm2_config, n_slots=4, context_total=4096) == (1024, 4096)
    assert plan(smollm2_config, n_slots=4, max_context=2048) == (2048, 4 * 2048)
    assert plan(smollm2_config, n_slots=4, max_context=2048, kv_cache_tokens=4096) == (2048, 4096)
    assert plan(smollm2_config, n_slots=4, kv_cache_tokens=4096) == (4096, 4096)   # no context beyond the pool
    # Beyond the trained context: allowed, with a warning that names the flag; cut to it for a model loaded on
    # demand (fit_trained).
    assert plan(smollm2_config, max_context=16384) == (16384, 16384)
    assert plan(smollm2_config, n_slots=2, context_total=32768) == (16384, 32768)
    assert plan(smollm2_config, max_context=16384, fit_trained=True) == (8192, 8192)
    assert plan(smollm2_config, n_slots=2, context_total=32768, fit_trained=True) == (8192, 32768)


@pytest.mark.parametrize(("fields", "warning"), [
    ({"max_context": 16384}, "a context of 16384 tokens per slot (--max-context) is beyond the 8192 tokens the model "
                             "was trained on: output past position 8192 may degrade"),
    ({"n_slots": 2, "context_total": 32768}, "a context of 16384 tokens per slot (-c/--ctx-size over the slots)"),
    ({"max_context": 16384, "context_total": 16384}, "a context of 16384 tokens per slot (-c/--ctx-size) is beyond"),
    ({"max_context": 8192}, None),
    ({"n_slots": 4, "context_total": 32768}, None),
])
def test_a_context_beyond_the_trained_one_has_a_warning(smollm2_config, fields, warning):
    options = EngineOptions(**{"max_context": None, **fields}).resolved()
    max_context, _ = plan_context(options, smollm2_config, 64 * GIB)
    found = context_warning(options, smollm2_config, max_context)
    assert (found is None) if warning is None else found.startswith(warning), found
    # -c split between slots must leave each at least 2 tokens; one pool that any slot fills (as llama-server
    # without -np) needs 2 in all.
    with pytest.raises(ValueError, match="a total context of 7 tokens .-c. leaves a slot less than 2"):
        EngineOptions(n_slots=4, max_context=None, context_total=7).check()
    EngineOptions(n_slots=4, max_context=7, context_total=7).check()


def test_the_pool_is_sized_from_memory(smollm2_config):
    token = per_token(smollm2_config)
    budget = 3000 * token + 5                       # room for 2992 tokens (whole blocks of 16)
    # Defaults shrink: four slots share a pool of what fits, and no slot's context is larger than the pool.
    assert plan(smollm2_config, n_slots=4, kv_memory=budget) == (2992, 2992)
    assert plan(smollm2_config, n_slots=4, max_context=1024, kv_memory=budget) == (1024, 2992)
    # The default budget is a share of the memory available.
    assert plan(smollm2_config, n_slots=4, available=4 * 3000 * token) == (2992, 2992)
    # What was asked for and does not fit is refused, naming the sizes and the flags.
    with pytest.raises(ContextSizeError, match=r"a KV pool of 4096 tokens needs 0\.\d\d GiB, more than the "
                                               r"--kv-memory budget .* lower -c, --max-context or --slots"):
        plan(smollm2_config, n_slots=4, context_total=4096, kv_memory=budget)
    with pytest.raises(ContextSizeError, match="a KV pool of 4096 tokens"):
        plan(smollm2_config, kv_cache_tokens=4096, kv_memory=budget)
    with pytest.raises(ContextSizeError, match="8192 tokens .* than 25% of the 0.2 GiB of memory available"):
        plan(smollm2_config, max_context=8192, available=8192 * token)
    with pytest.raises(ContextSizeError, match="not one block"):
        plan(smollm2_config, kv_memory=token)
    # Slots that each reserve their context (no paged pool) split what fits.
    assert plan(smollm2_config, n_slots=2, continuous_batching=False, kv_memory=budget) == (1488, 2992)
    with pytest.raises(ContextSizeError, match="256 slots that each reserve their context do not fit"):
        plan(smollm2_config, n_slots=256, continuous_batching=False, kv_memory=budget)


def test_an_engine_gets_what_was_planned(smollm2_base: Path, smollm2_config):
    token = per_token(smollm2_config)
    engine = build_engine(smollm2_base, EngineOptions(max_context=None, n_slots=2, continuous_batching=True,
                                                      kv_memory=5000 * token))
    try:
        assert engine.info.n_ctx == 4992
        assert engine.stats()["kv_bytes"] == 4992 * token
    finally:
        engine.close()
    engine = build_engine(smollm2_base, EngineOptions(max_context=None, n_slots=2, kv_memory=5000 * token))
    try:
        assert engine.info.n_ctx == 2496
    finally:
        engine.close()


@pytest.mark.parametrize(("k", "v"), [("f16", "f16"), pytest.param("q8_0", "q8_0", marks=pytest.mark.slow),
                                      pytest.param("bf16", "q8_0", marks=pytest.mark.slow)])
def test_the_planned_bytes_are_the_pool_bytes_on_every_family(tiny_f32_bases: dict[str, Path], gemma3_base: Path,
                                                              k: str, v: str):
    """The plan counts a token's KV from the config (hybrids keep KV in their full-attention layers only; Gemma 3's
    sliding-window layers have a pool of their own, here as many positions as the one slot's context) and the KV
    types; the engine allocates it from the built layers: the two agree for every family."""
    for name, path in {**tiny_f32_bases, "gemma3": gemma3_base}.items():
        with BaseFile(path) as base:
            config = read_config(base)
        if "q8_0" in (k, v) and config.head_dim % 32:
            continue   # q8_0 rows hold 32 values: not the tiny Qwen2's heads of 16
        options = EngineOptions(max_context=256, n_slots=1, paged_kv=True, kv_cache_tokens=256, cache_type_k=k,
                                cache_type_v=v)
        assert plan_context(options, config) == (256, 256)
        engine = build_engine(path, options)
        try:
            assert engine.stats()["kv_bytes"] == 256 * (per_token(config, k, v) + per_window_token(config, k, v)), name
        finally:
            engine.close()


def test_q8_0_kv_fits_a_pool_that_f16_does_not(smollm2_config):
    """A q8_0 row of 64 values takes 68 bytes against f16's 128: the same budget holds 1.88 times the tokens."""
    budget = 100 * 2**20
    with pytest.raises(ContextSizeError, match="a KV pool of 8192 tokens needs 0.18 GiB"):
        plan(smollm2_config, context_total=8192, kv_memory=budget)
    assert plan(smollm2_config, context_total=8192, kv_memory=budget, cache_type_k="q8_0", cache_type_v="q8_0") == \
        (8192, 8192)
    assert per_token(smollm2_config, "q8_0", "q8_0") / per_token(smollm2_config) == 68 / 128


def serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "basert", "serve", *args, "--port", "1"], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ))


@pytest.mark.parametrize(("flags", "message"), [
    (("-c", "8192", "--kv-memory", "1MiB"), "a KV pool of 8192 tokens needs 0.18 GiB, more than the --kv-memory "
                                            "budget of 0.00 GiB"),
    # Beyond the trained context, what the memory cannot hold is still refused.
    (("--max-context", "65536", "--kv-memory", "256MiB"), "a KV pool of 65536 tokens needs 1.41 GiB, more than the "
                                                          "--kv-memory budget of 0.25 GiB"),
    (("-ctk", "q4_9"), "unknown KV cache type 'q4_9': use one of f32, f16, bf16, q8_0 (--cache-type-k)"),
    (("--cache-type-v", "int8"), "unknown KV cache type 'int8': use one of f32, f16, bf16, q8_0 (--cache-type-v)"),
])
def test_serve_refuses_what_the_memory_cannot_hold(smollm2_base: Path, flags, message):
    result = serve(str(smollm2_base), *flags)
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert "Traceback" not in result.stderr


def test_serve_takes_the_trained_context_and_c_as_llama_cpp(smollm2_base: Path, tmp_path: Path):
    with ServerProcess(smollm2_base, "-np", "2", log_path=tmp_path / "default.log") as server:
        props = httpx.get(server.url + "/props").json()
        assert props["default_generation_settings"]["n_ctx"] == 8192
        assert "2 slot(s), KV paged: 1024 blocks of 16 tokens" in server.log_text()
    with ServerProcess(smollm2_base, "-c", "4096", "-np", "2", log_path=tmp_path / "c.log") as server:
        props = httpx.get(server.url + "/props").json()
        assert props["default_generation_settings"]["n_ctx"] == 2048 and props["total_slots"] == 2
        assert "2 slot(s), KV paged: 256 blocks of 16 tokens" in server.log_text()
        # A prompt beyond a slot's share is the usual 400.
        response = httpx.post(server.url + "/completion", json={"prompt": "hi " * 2100, "n_predict": 1}, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["type"] == "exceed_context_size_error"
    # Without -np, as llama-server: the default slots share one pool of -c tokens, and any of them may fill it.
    with ServerProcess(smollm2_base, "-c", "4096", log_path=tmp_path / "unified.log") as server:
        props = httpx.get(server.url + "/props").json()
        assert props["default_generation_settings"]["n_ctx"] == 4096 and props["total_slots"] == 4
        assert "4 slot(s), KV paged: 256 blocks of 16 tokens" in server.log_text()


@pytest.mark.parametrize(("flags", "flag"), [(("-c", "8192"), "-c/--ctx-size"),
                                             (("--max-context", "4096"), "--max-context")])
def test_serve_beyond_the_trained_context_warns_once_and_answers(qwen35_chat_base: Path, tmp_path: Path, flags, flag):
    """As llama-server with a fixed -c: a model trained on 2,048 tokens (the tiny hybrid) starts with one warning line,
    /props repeats it, and a prompt past position 2,048 is answered."""
    n_ctx = int(flags[1])
    warning = (f"a context of {n_ctx} tokens per slot ({flag}) is beyond the 2048 tokens the model was trained on: "
               "output past position 2048 may degrade")
    with ServerProcess(qwen35_chat_base, *flags, log_path=tmp_path / "beyond.log") as server:
        props = httpx.get(server.url + "/props").json()
        assert props["n_ctx_train"] == 2048 and props["default_generation_settings"]["n_ctx"] == n_ctx
        assert props["warnings"] == [warning]
        response = httpx.post(server.url + "/completion", json={"prompt": "hi " * 3000, "n_predict": 4,
                                                               "temperature": 0}, timeout=120)
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["tokens_evaluated"] > 2048 and answer["tokens_predicted"] == 4
    warnings = [line for line in server.log_text().splitlines() if " WARNING " in line]
    assert len(warnings) == 1 and warnings[0].endswith(warning), warnings


def test_serve_with_q8_0_kv_reports_its_smaller_pool(smollm2_base: Path, smollm2_config, tmp_path: Path):
    """-ctk/-ctv q8_0: the same 4,096-token pool in 68 bytes per kv head row instead of f16's 128, as /metrics says;
    the server answers as usual."""
    with ServerProcess(smollm2_base, "-c", "4096", "-ctk", "q8_0", "-ctv", "q8_0", "--metrics",
                       log_path=tmp_path / "q8.log") as server:
        response = httpx.post(server.url + "/v1/completions", json={"prompt": "The capital of France is",
                                                                     "max_tokens": 8, "temperature": 0}, timeout=60)
        assert response.status_code == 200 and response.json()["choices"][0]["text"]
        metrics = httpx.get(server.url + "/metrics").text
    line = next(line for line in metrics.splitlines() if line.startswith("basert_kv_bytes{"))
    assert float(line.split()[-1]) == 4096 * per_token(smollm2_config, "q8_0", "q8_0")
