"""Every CPU variant of the kernels (basert._ext.<variant>) gives the portable variant's bits on the same inputs:
matmul for every weight kind and batch size, the other kernels, and whole forwards of SmolLM2 and a hybrid model
run in subprocesses with BASERT_CPU set."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_files import random_blocks

import basert._ext as ext
from basert._ext import matmul
from basert._ext.kvtypes import kv_type
from basert.format.quant import f32_to_bf16_bits, quantize

ROOT = Path(__file__).resolve().parent.parent
NATIVE = ext.supported_variants()[-1]
# Every variant other than portable, each checked against portable; one this CPU lacks is skipped.
OTHERS = [
    pytest.param(v, marks=pytest.mark.skipif(
        v not in ext.supported_variants(),
        reason=f"{v}: {'this CPU lacks its instructions' if not ext.cpu_supports(v) else 'not built'}"))
    for v in ext.VARIANTS if v != "portable"
]


def kernels(variant: str, module: str):
    return importlib.import_module(f"basert._ext.{variant}.{module}")


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_native_variant_is_chosen_and_registered() -> None:
    assert ext.VARIANT == os.environ.get("BASERT_CPU", NATIVE)
    assert "portable" in ext.supported_variants()
    for name in ext.module_names(ext.VARIANT):
        module = importlib.import_module(f"basert._ext.{name}")
        assert module is kernels(ext.VARIANT, name)
        assert Path(module.__file__).parent.name == ext.VARIANT
    assert {"attention", "deltanet", "matmul", "norm", "ops"} <= set(ext.module_names(ext.VARIANT))


def test_unknown_or_unsupported_variant_is_a_clear_error() -> None:
    code = "import basert._ext"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "BASERT_CPU": "sse9"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    assert result.returncode != 0 and "BASERT_CPU='sse9'" in result.stderr and "portable, avx2, avx512" in result.stderr
    lacking = [v for v in ext.VARIANTS if not ext.cpu_supports(v)]
    if lacking:
        env["BASERT_CPU"] = lacking[0]
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
        assert result.returncode != 0 and "this CPU lacks" in result.stderr


def test_a_build_compiles_portable_and_this_cpus_best_variant_unless_told_otherwise() -> None:
    from basert._ext.cpu import VARIANTS, best_variant, variants_to_build

    assert variants_to_build(None) == variants_to_build("") == sorted({"portable", best_variant()}, key=VARIANTS.index)
    assert variants_to_build("all") == list(VARIANTS)
    assert variants_to_build("avx512") == ["portable", "avx512"]
    assert variants_to_build(" avx2 , portable ") == ["portable", "avx2"]
    with pytest.raises(ValueError, match="unknown variant avx3"):
        variants_to_build("avx2,avx3")


@pytest.mark.skipif(ext.cpu_supports("avx2") is False, reason="this CPU runs only the portable kernels")
def test_an_install_without_this_cpus_variant_runs_portable_and_says_so_once(tmp_path: Path) -> None:
    # An install built with BASERT_BUILD_VARIANTS=portable: the same package with only the portable kernels.
    def leave_out(folder: str, names: list[str]) -> list[str]:
        other_variant = Path(folder).name in ("avx2", "avx512")
        return [n for n in names if n == "__pycache__" or (other_variant and n.endswith(".so"))]

    shutil.copytree(ROOT / "basert", tmp_path / "basert", ignore=leave_out)
    env = {k: v for k, v in os.environ.items() if k != "BASERT_CPU"}
    env["PYTHONPATH"] = str(tmp_path)
    code = ("import basert._ext as e; from basert._ext import matmul; "
            "print(e.VARIANT, e.built_variants(), matmul.__file__)")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    variant, built, path = result.stdout.split(" ", 2)
    assert (variant, built) == ("portable", "['portable']")
    assert path.startswith(str(tmp_path / "basert" / "_ext" / "portable"))
    [line] = result.stderr.splitlines()
    assert line.startswith(f"basert: this CPU runs the {ext.best_variant()} kernels, but this install has only "
                           "portable: using portable")


# ---- matmul ----

DENSE_KINDS = ("f32", "f16", "bf16")
QUANT_SPECS = [(kind, group, symmetric, scale_dtype)
               for kind in ("base_q4", "base_q8") for group in (32, 64, 128) for symmetric in (False, True)
               for scale_dtype in ("f16", "bf16")]
# Groups that are not multiples of 16 put a group boundary inside a 16-lane vector, and a tail after the last one.
ODD_GROUP_SPECS = [("base_q4", 8, False, "f16"), ("base_q8", 24, True, "bf16"), ("base_q4", 40, True, "f16")]
M_VALUES = (1, 2, 3, 4, 5, 7, 8, 16, 17, 33, 512)


def weight_parts(kind: str, n: int, k: int, rng: np.random.Generator, group: int = 0, symmetric: bool = False,
                 scale_dtype: str = "f16") -> tuple:
    """Arguments of matmul.Weight for random values stored as `kind`."""
    values = rng.standard_normal((n, k), dtype=np.float32) * np.float32(0.5)
    if kind == "f32":
        return (kind, n, k, values.reshape(-1).view(np.uint8))
    if kind == "f16":
        return (kind, n, k, values.astype(np.float16).reshape(-1).view(np.uint8))
    if kind == "bf16":
        return (kind, n, k, f32_to_bf16_bits(values).reshape(-1).view(np.uint8))
    q = quantize(values, kind, group, symmetric=symmetric, scale_dtype=scale_dtype)
    return (kind, n, k, q.packed, q.scales, q.biases, group, scale_dtype)


def matmul_bits(variant: str, parts: tuple, x: np.ndarray, exact: bool | None = None) -> np.ndarray:
    mm = kernels(variant, "matmul")
    weight = mm.Weight(*parts, exact=exact)
    out = np.full((x.shape[0], weight.n), np.nan, dtype=np.float32)
    mm.matmul(x, weight, out)
    return out


@pytest.mark.parametrize("variant", OTHERS)
@pytest.mark.parametrize("kind", DENSE_KINDS)
@pytest.mark.parametrize("k", (13, 100, 257, 584, 1001))
def test_dense_matmul_bits(variant: str, kind: str, k: int) -> None:
    rng = np.random.default_rng(k)
    parts = weight_parts(kind, 37, k, rng)
    x = rng.standard_normal((max(M_VALUES), k), dtype=np.float32)
    for m in M_VALUES:
        assert same_bits(matmul_bits(variant, parts, x[:m]), matmul_bits("portable", parts, x[:m])), (kind, k, m)


# Rows of few groups at every M; rows of many groups at every M but the largest by default (M = 512 runs the same
# kernels as M = 33 on more rows, and is most of the time), at M = 512 under -m slow.
ROW_SHAPES = [pytest.param("few", M_VALUES, id="few"), pytest.param("many", M_VALUES[:-1], id="many"),
              pytest.param("many", M_VALUES[-1:], id="many-m512", marks=pytest.mark.slow)]


@pytest.mark.parametrize("variant", OTHERS)
@pytest.mark.parametrize("spec", QUANT_SPECS + ODD_GROUP_SPECS, ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize(("groups", "m_values"), ROW_SHAPES)
@pytest.mark.parametrize("path", ("integer", "exact"))
def test_quantized_matmul_bits(variant: str, spec: tuple, groups: str, m_values: tuple[int, ...], path: str) -> None:
    """Both paths of quantized weights: 16-bit activations in integer dot products (groups of a multiple of 32; others
    take the float path either way) and the exact float32 one."""
    kind, group, symmetric, scale_dtype = spec
    exact = path == "exact"
    # "many": rows of 65 groups, past the 64 groups whose scales the streaming kernel converts at once.
    k = group * (65 if groups == "many" else 5 if group % 16 else 3)
    rng = np.random.default_rng(group)
    parts = weight_parts(kind, 41, k, rng, group, symmetric, scale_dtype)
    x = rng.standard_normal((max(M_VALUES), k), dtype=np.float32)
    for m in m_values:
        ours, portable = matmul_bits(variant, parts, x[:m], exact), matmul_bits("portable", parts, x[:m], exact)
        assert same_bits(ours, portable), (spec, m)


@pytest.mark.parametrize("variant", OTHERS)
@pytest.mark.parametrize("kind", sorted(matmul.BLOCK_KINDS))
@pytest.mark.parametrize("path", ("integer", "exact"))
def test_gguf_block_matmul_bits(variant: str, kind: str, path: str) -> None:
    """Both paths of the GGUF blocks (Q2_K takes the float path either way)."""
    rng = np.random.default_rng(matmul.BLOCK_KINDS[kind])
    values = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][0]
    k = 2 * values if values == 256 else 5 * values
    parts = (kind, 19, k, random_blocks(rng, gguf.GGMLQuantizationType[kind], 19, k).reshape(-1))
    x = rng.standard_normal((max(M_VALUES), k), dtype=np.float32)
    exact = path == "exact"
    for m in M_VALUES:
        ours, portable = matmul_bits(variant, parts, x[:m], exact), matmul_bits("portable", parts, x[:m], exact)
        assert same_bits(ours, portable), (kind, m)


@pytest.mark.parametrize("variant", OTHERS)
def test_matmul_many_and_embed_rows_bits(variant: str) -> None:
    rng = np.random.default_rng(3)
    k = 576
    specs = [weight_parts("base_q4", 64, k, rng, 32), weight_parts("base_q8", 24, k, rng, 32, True),
             weight_parts("bf16", 9, k, rng), weight_parts("f16", 33, k, rng)]
    x = rng.standard_normal((16, k), dtype=np.float32)
    ids = rng.integers(0, 9, 40).astype(np.int32)
    results = {}
    for v in ("portable", variant):
        mm = kernels(v, "matmul")
        weights = [mm.Weight(*parts) for parts in specs]
        for m in (1, 3, 16):
            outs = [np.empty((m, w.n), dtype=np.float32) for w in weights]
            mm.matmul_many(x[:m], weights, outs)
            results[v, "many", m] = outs
        for i, w in enumerate(weights):
            out = np.empty((len(ids), k), dtype=np.float32)
            mm.embed_rows(w, ids, out)
            results[v, "embed", i] = [out]
    for key in [key for key in results if key[0] == "portable"]:
        other = results[(variant, *key[1:])]
        assert all(same_bits(a, b) for a, b in zip(results[key], other)), key


@pytest.mark.parametrize("variant", OTHERS)
def test_every_f16_value_converts_alike(variant: str) -> None:
    """All 65536 f16 bit patterns (NaN payloads included) as f16 weights and as f16 scales."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    k = bits.size + 3  # the last 3 values go through the scalar tail conversion too
    row = np.concatenate([bits, bits[-3:]])
    results = {}
    for v in ("portable", variant):
        mm = kernels(v, "matmul")
        # Two rows: the second starts 3 values later, so every value also meets the scalar tail's position.
        data = np.concatenate([row, np.roll(row, -3)]).view(np.uint8)
        weight = mm.Weight("f16", 2, k, data)
        out = np.empty((2, k), dtype=np.float32)
        mm.embed_rows(weight, np.array([0, 1], dtype=np.int32), out)
        # As scales of q8 groups whose codes are all 1 with zero biases: each weight is its scale.
        groups = bits.size
        qweight = mm.Weight("base_q8", groups, 32, np.ones(groups * 32, np.uint8), bits,
                            np.zeros(groups, np.uint16), 32, "f16")
        qout = np.empty((groups, 32), dtype=np.float32)
        mm.embed_rows(qweight, np.arange(groups, dtype=np.int32), qout)
        results[v] = (out, qout)
    assert same_bits(results[variant][0], results["portable"][0])
    assert same_bits(results[variant][1], results["portable"][1])
    # The exact conversion (numpy's), where a signalling NaN becomes quiet (as F16C converts it), payload kept.
    expected = bits.view(np.float16).astype(np.float32).view(np.uint32)
    expected = np.where(np.isnan(expected.view(np.float32)), expected | np.uint32(0x400000), expected)
    assert np.array_equal(results["portable"][0][0, : bits.size].view(np.uint32), expected)


# ---- the other kernels ----

def run_norm_ops(variant: str, rng_seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(rng_seed)
    norm, ops = kernels(variant, "norm"), kernels(variant, "ops")
    outs = []
    for d in (7, 64, 100, 576):
        x = rng.standard_normal((5, d), dtype=np.float32)
        w = rng.standard_normal(d, dtype=np.float32)
        out = np.empty_like(x)
        norm.rmsnorm(x, w, 1e-5, out)
        outs.append(out)
        heads = rng.standard_normal((3, 4, d), dtype=np.float32)
        ops.rmsnorm_heads(heads, w, 1e-6)
        outs.append(heads)
        z = rng.standard_normal((3, 4, d), dtype=np.float32) * 4
        gated = np.empty_like(z)
        ops.gated_rmsnorm(rng.standard_normal((3, 4, d), dtype=np.float32), z, w, 1e-6, gated)
        outs.append(gated)
        gate = rng.standard_normal((5, d), dtype=np.float32) * 30  # exp over a wide range, overflow included
        up = rng.standard_normal((5, d), dtype=np.float32)
        swiglu = np.empty_like(gate)
        ops.silu_mul(gate, up, swiglu)
        outs.append(swiglu)
        geglu = np.empty_like(gate)
        ops.gelu_tanh_mul(gate, up, geglu)
        outs.append(geglu)
        sig = up.copy()
        ops.sigmoid_mul(sig, gate)
        outs.append(sig)
    cos, sin = ops.rope_tables(10000.0, 64, 64)
    for interleaved in (False, True):
        x = rng.standard_normal((6, 3, 64), dtype=np.float32)
        ops.rope(x, rng.integers(0, 64, 6).astype(np.int32), cos, sin, interleaved)
        outs.append(x)
    return outs


def run_attention(variant: str) -> list[np.ndarray]:
    rng = np.random.default_rng(11)
    attn = kernels(variant, "attention")
    outs = []
    for k_type, v_type in (("f32", "f32"), ("f16", "f16"), ("bf16", "bf16"), ("q8_0", "q8_0"), ("q8_0", "f16")):
        for d in (64, 72) if k_type != "q8_0" else (64, 96):
            n_blocks, n_kv, H, T = 6, 2, 6, 37
            k_cache, v_cache = (np.zeros((n_blocks, n_kv, 16, kv_type(name).row_units(d)), dtype=kv_type(name).storage)
                                for name in (k_type, v_type))
            table = rng.permutation(n_blocks)[:3].astype(np.int32)
            k = rng.standard_normal((T, n_kv, d), dtype=np.float32)
            v = rng.standard_normal((T, n_kv, d), dtype=np.float32)
            attn.kv_write(k_cache, v_cache, k, v, table, 0)
            q = rng.standard_normal((T, H, d), dtype=np.float32)
            out = np.empty_like(q)
            attn.attention(q, k_cache, v_cache, table, 0, d ** -0.5, out)
            outs += [k_cache, v_cache, out]
            one = np.empty_like(q[:1])
            attn.attention(np.ascontiguousarray(q[-1:]), k_cache, v_cache, table, T - 1, d ** -0.5, one)
            outs.append(one)
            for window in (1, 9, 20):   # a sliding window: rows that skip whole 8-position groups, or part of one
                windowed = np.empty_like(q)
                attn.attention_batch(q, k_cache, v_cache, table[None, :], np.zeros(1, dtype=np.int32),
                                     np.array([T], dtype=np.int32), np.zeros(1, dtype=np.int32), d ** -0.5,
                                     windowed, window)
                outs.append(windowed)
    return outs


def run_deltanet(variant: str) -> list[np.ndarray]:
    rng = np.random.default_rng(12)
    gdn = kernels(variant, "deltanet")
    T, C, K = 9, 96, 4
    x = rng.standard_normal((T, C), dtype=np.float32)
    state = rng.standard_normal((C, K - 1), dtype=np.float32)
    conv = np.empty_like(x)
    gdn.gdn_conv(x, state, rng.standard_normal((C, K), dtype=np.float32), conv)
    n_k, n_v, dk, dv = 2, 4, 24, 40
    a, b = rng.standard_normal((T, n_v), dtype=np.float32), rng.standard_normal((T, n_v), dtype=np.float32)
    g, beta = np.empty_like(a), np.empty_like(a)
    gdn.gdn_gates(a, b, rng.standard_normal(n_v, dtype=np.float32), rng.standard_normal(n_v, dtype=np.float32),
                  g, beta)
    q = rng.standard_normal((T, n_k, dk), dtype=np.float32)
    k = rng.standard_normal((T, n_k, dk), dtype=np.float32)
    v = rng.standard_normal((T, n_v, dv), dtype=np.float32)
    rec = rng.standard_normal((n_v, dk, dv), dtype=np.float32)
    out = np.empty((T, n_v, dv), dtype=np.float32)
    gdn.gdn_recurrent(q, k, v, g, beta, rec, out)
    return [conv, state, g, beta, rec, out]


@pytest.mark.parametrize("variant", OTHERS)
@pytest.mark.parametrize("run", [lambda v: run_norm_ops(v, 5), run_attention, run_deltanet],
                         ids=["norm-ops", "attention", "deltanet"])
def test_other_kernels_bits(variant: str, run) -> None:
    expected, got = run("portable"), run(variant)
    assert len(expected) == len(got)
    for i, (a, b) in enumerate(zip(expected, got)):
        assert same_bits(a, b), f"output {i}"


# ---- whole models ----

FORWARD = """
import json, sys
import numpy as np
import basert._ext
from basert.engine.runner import ForwardRequest, ModelRunner

path, prompt, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
runner = ModelRunner(path, max_context=64)
seq = runner.new_sequence()
last = runner.forward([ForwardRequest(seq, prompt)])[0][-1].copy()
step = runner.forward([ForwardRequest(seq, [int(np.argmax(last))])])[0][-1].copy()
np.save(out, np.stack([last, step]))
runner.close()
print(basert._ext.VARIANT)
"""


def forward_logits(path: Path, variant: str, tmp_path: Path, prompt: list[int]) -> np.ndarray:
    """Last-position logits of a prompt, then of one decoded token, computed with BASERT_CPU=variant."""
    out = tmp_path / f"{path.stem}-{variant}.npy"
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "BASERT_CPU": variant, "PYTHONPATH": pythonpath}
    result = subprocess.run([sys.executable, "-c", FORWARD, str(path), json.dumps(prompt), str(out)], env=env,
                            capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == [variant]
    return np.load(out)


@pytest.mark.parametrize("variant", OTHERS)
# The default run keeps the default model (its 4-bit weights through the byte kernels); the hybrid's forward (linear
# attention, 8-bit weights; each of its kernels is compared one by one above) and Gemma 3's run under -m slow.
@pytest.mark.parametrize("model", ["smollm2_base", pytest.param("qwen35_chat_base", marks=pytest.mark.slow),
                                   pytest.param("gemma3_base", marks=pytest.mark.slow)])
def test_model_forward_bits(variant: str, model: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    path = request.getfixturevalue(model)
    prompt = [1, 504, 3303, 282, 4649, 314, 2670, 30]  # 8 tokens; every id is in both vocabularies
    expected = forward_logits(path, "portable", tmp_path, prompt)
    got = forward_logits(path, variant, tmp_path, prompt)
    assert np.isfinite(expected).all()
    assert same_bits(got, expected)
