"""The integer path of quantized weights (matmul.h's contract: base_q4 / base_q8 and the GGUF blocks Q4_K, Q5_K,
Q6_K, Q5_0, Q5_1): activations quantized to 8 bits (the default) or 16 bits (a weight's act_bits) per block of 32 and
integer dot products, against a numpy reference that performs the same integer sums and float32 operations, so the
kernels must match it bit for bit on every CPU variant; then batch, thread and fused-call invariance, the tolerance
against the exact float32 path, and which weights take which path."""

from __future__ import annotations

from collections.abc import Iterator

import gguf
import numpy as np
import pytest
from gguf_files import random_blocks

from basert._ext import VARIANT
from basert._ext import matmul as mm
from basert.format.quant import QuantizedTensor, dequantize, quantize, scale_values, unpack_q4

KINDS = [(kind, group, symmetric, scale_dtype)
         for kind in ("base_q4", "base_q8")
         for group in (32, 64, 128)
         for symmetric in (False, True)
         for scale_dtype in ("f16", "bf16")]
K_VALUES = {32: (32, 96, 576, 2080), 64: (64, 576, 2112), 128: (128, 1152, 2176)}
M_VALUES = (1, 2, 3, 4, 5, 7, 8, 9, 17, 64, 130)
N_VALUES = (1, 7, 8, 33, 100)


def kind_id(case: tuple[str, int, bool, str]) -> str:
    kind, group, symmetric, scale_dtype = case
    return f"{kind}-g{group}-{'sym' if symmetric else 'asym'}-{scale_dtype}"


# The largest activation code of each width (matmul.h).
QMAX = {8: np.float32(127), 16: np.float32(16383)}
# Where value j of a block of 32 sits in an activation record: the even-numbered values first, then the odd ones.
RECORD_ORDER = np.concatenate([np.arange(0, 32, 2), np.arange(1, 32, 2)])


def quantize_activations(x: np.ndarray, bits: int = 8) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes int16 [M, K], scales float32 [M, K/32], block sums int32 [M, K/32]) as matmul.h defines them."""
    m, k = x.shape
    qmax = QMAX[bits]
    blocks = x.reshape(m, k // 32, 32)
    scale = np.abs(blocks).max(axis=2) / qmax
    inv = np.divide(np.float32(1), scale, out=np.zeros_like(scale), where=scale != 0)
    codes = np.rint(np.clip(blocks * inv[:, :, None], -qmax, qmax)).astype(np.int16)
    sums = codes.astype(np.int32).sum(axis=2)
    return codes.reshape(m, k), scale.astype(np.float32), sums


def in_record_order(codes: np.ndarray) -> np.ndarray:
    m, k = codes.shape
    return codes.reshape(m, k // 32, 32)[:, :, RECORD_ORDER].reshape(m, k)


def base_ints(q: QuantizedTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A base weight's blocks as matmul.h reads them: integers w [N, K/32, 32], A and B [N, K/32] (B None without)."""
    n, k = q.shape
    blocks = k // 32
    w = (unpack_q4(q.packed) if q.dtype == "base_q4" else q.packed).reshape(n, blocks, 32).astype(np.int64)
    if q.symmetric:
        w -= 8 if q.dtype == "base_q4" else 128
    group_of = np.arange(blocks) * 32 // q.group_size
    a = scale_values(q.scales, q.scale_dtype).reshape(n, -1)[:, group_of]
    b = None if q.symmetric else scale_values(q.biases, q.scale_dtype).reshape(n, -1)[:, group_of]
    return w, a, b


def f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view("<f2").astype(np.float32)[..., 0]


def k_scale_min(sc: np.ndarray, s: int) -> tuple[np.ndarray, np.ndarray]:
    """The six-bit scale and min of sub-block s from the 12 packed bytes sc [..., 12] (Q4_K, Q5_K)."""
    sc = sc.astype(np.int64)
    if s < 4:
        return sc[..., s] & 63, sc[..., 4 + s] & 63
    return (sc[..., 4 + s] & 15) | ((sc[..., s - 4] >> 2) & 48), (sc[..., 4 + s] >> 4) | ((sc[..., s] >> 2) & 48)


def gguf_ints(kind: str, raw: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """GGUF blocks [N, row bytes] as matmul.h reads them: integers w [N, K/32, 32], A and B [N, K/32]."""
    qtype = gguf.GGMLQuantizationType[kind]
    size, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    n = raw.shape[0]
    blk = raw.reshape(n, k // size, nbytes)
    j = np.arange(32)
    if kind in ("Q5_0", "Q5_1"):
        with_min = kind == "Q5_1"
        qh = blk[..., 4 if with_min else 2:][..., :4].copy().view("<u4")[..., 0].astype(np.int64)
        qs = blk[..., 8 if with_min else 6:].astype(np.int64)
        u = ((qs[..., j & 15] >> (4 * (j >> 4))) & 15) | (((qh[..., None] >> j) & 1) << 4)
        return (u if with_min else u - 16), f16(blk[..., 0:2]), f16(blk[..., 2:4]) if with_min else None
    w = np.zeros((n, k // 256, 8, 32), dtype=np.int64)
    a = np.zeros((n, k // 256, 8), dtype=np.float32)
    b = np.zeros((n, k // 256, 8), dtype=np.float32)
    for sub in range(8):
        if kind in ("Q4_K", "Q5_K"):
            five = kind == "Q5_K"
            qs = blk[..., (48 if five else 16) + 32 * (sub >> 1):][..., :32].astype(np.int64)
            u = (qs >> (4 * (sub & 1))) & 15
            if five:
                u |= ((blk[..., 16:48].astype(np.int64) >> sub) & 1) << 4
            scale, low = k_scale_min(blk[..., 4:16], sub)
            w[:, :, sub] = u
            a[:, :, sub] = f16(blk[..., 0:2]) * scale.astype(np.float32)
            b[:, :, sub] = -(f16(blk[..., 2:4]) * low.astype(np.float32))
        elif kind == "Q3_K":
            h, t = sub >> 2, sub & 3
            low = (blk[..., 32 + 32 * h:][..., :32].astype(np.int64) >> (2 * t)) & 3
            high = (blk[..., 0:32].astype(np.int64) >> sub) & 1
            scales = np.stack([q3_k_scale(blk[..., 96:108], 2 * sub + half) for half in (0, 1)], axis=-1)
            w[:, :, sub] = scales[..., j >> 4] * (low + 4 * high - 4)
            a[:, :, sub] = f16(blk[..., 108:110])
        else:  # Q6_K
            h, t = sub >> 2, sub & 3
            low = (blk[..., 64 * h + 32 * (t & 1):][..., :32].astype(np.int64) >> (4 * (t >> 1))) & 15
            high = (blk[..., 128 + 32 * h:][..., :32].astype(np.int64) >> (2 * t)) & 3
            scales = blk[..., 192 + 2 * sub:194 + 2 * sub].view(np.int8).astype(np.int64)
            w[:, :, sub] = scales[..., j >> 4] * ((low | (high << 4)) - 32)
            a[:, :, sub] = f16(blk[..., 208:210])
    return (w.reshape(n, k // 32, 32), a.reshape(n, -1),
            None if kind in ("Q3_K", "Q6_K") else b.reshape(n, -1))


def q3_k_scale(packed: np.ndarray, index: int) -> np.ndarray:
    """Q3_K's signed six-bit scale `index` (of 16) from its 12 packed bytes [..., 12], as blocks.h reads it."""
    low = (packed[..., index & 7].astype(np.int64) >> (4 * (index >> 3))) & 15
    high = (packed[..., 8 + (index & 3)].astype(np.int64) >> (2 * (index >> 2))) & 3
    return (low | (high << 4)) - 32


def integer_reference(x: np.ndarray, w: np.ndarray, a: np.ndarray, b: np.ndarray | None, bits: int = 8) -> np.ndarray:
    """out[M, N] by the integer contract: exact block sums I, then (A * d) * I (+ (B * d) * S) summed in block order."""
    m, blocks = x.shape[0], w.shape[1]
    q, d, sums = quantize_activations(x, bits)
    q = q.reshape(m, blocks, 32).astype(np.int64)
    block_sums = sums.astype(np.float32)
    dots = np.einsum("nbj,mbj->mnb", w, q).astype(np.float32)
    out = np.zeros((m, w.shape[0]), dtype=np.float32)
    for i in range(blocks):
        t = (a[None, :, i] * d[:, None, i]) * dots[:, :, i]
        if b is not None:
            t = t + (b[None, :, i] * d[:, None, i]) * block_sums[:, None, i]
        out = out + t
    return out


def make(case: tuple[str, int, bool, str], n: int, k: int, seed: int,
         bits: int = 8) -> tuple[mm.Weight, QuantizedTensor, np.ndarray]:
    kind, group, symmetric, scale_dtype = case
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((n, k), dtype=np.float32) * np.float32(0.5)
    q = quantize(values, kind, group, symmetric=symmetric, scale_dtype=scale_dtype)
    weight = mm.Weight(kind, n, k, q.packed, q.scales, q.biases, group, scale_dtype, exact=False, act_bits=bits)
    return weight, q, values


def activations(m: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # Rows of very different magnitudes, and some blocks of zeros (scale 0).
    magnitude = np.float32(10.0) ** rng.integers(-3, 3, (m, 1)).astype(np.float32)
    x = rng.standard_normal((m, k), dtype=np.float32) * magnitude
    if k > 32:
        x[:, :32] = 0
    return x


def run(x: np.ndarray, weight: mm.Weight) -> np.ndarray:
    out = np.full((x.shape[0], weight.n), np.nan, dtype=np.float32)
    mm.matmul(np.ascontiguousarray(x), weight, out)
    return out


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.fixture
def threads() -> Iterator[None]:
    before = mm.get_num_threads()
    yield
    mm.set_num_threads(before)


@pytest.mark.parametrize("bits", (8, 16))
@pytest.mark.parametrize("k", (32, 64, 576, 2080))
def test_activation_quantization_matches_the_reference(k: int, bits: int) -> None:
    x = activations(5, k, seed=k)
    qmax = QMAX[bits]
    # Halfway values (x * (1/d) = j + 0.5 exactly for d = 1) round to even, as rint does.
    x[0, -32:] = qmax * np.sign(np.arange(32) - 15.5).astype(np.float32)
    x[1, -32:] = np.arange(32, dtype=np.float32) * (qmax / np.float32(32)) + np.float32(0.5)
    x[1, -1] = qmax
    codes, scales, sums = mm.QuantizedRows(x, bits).parts()
    want = quantize_activations(x, bits)
    assert np.array_equal(x[1, -32:] * (np.float32(1) / scales[1, -1]), x[1, -32:])  # d = 1 there
    assert np.array_equal(codes, in_record_order(want[0]))
    assert same_bits(scales, want[1])
    assert sums.dtype == np.float32 and np.array_equal(sums, want[2].astype(np.float32))  # exact integers


@pytest.mark.parametrize("bits", (8, 16))
@pytest.mark.parametrize("n", N_VALUES)
@pytest.mark.parametrize("case", KINDS, ids=kind_id)
def test_integer_path_matches_the_reference_bit_for_bit(case: tuple[str, int, bool, str], n: int, bits: int) -> None:
    for k in K_VALUES[case[1]]:
        weight, q, _ = make(case, n, k, seed=n * 7 + k, bits=bits)
        assert weight.integer and weight.act_bits == bits
        x = activations(max(M_VALUES), k, seed=k)
        out = run(x, weight)
        want = integer_reference(x, *base_ints(q), bits=bits)
        for m in M_VALUES:
            # Every batch size: the rows of a smaller batch are the same bits as in the largest.
            assert same_bits(run(x[:m], weight), want[:m]), f"K={k} M={m}"
        assert same_bits(out, want), f"K={k}"


@pytest.mark.parametrize("case", KINDS[::5], ids=kind_id)
def test_rows_do_not_depend_on_threads_or_fused_calls(case: tuple[str, int, bool, str], threads: None) -> None:
    weights = [make(case, n, 1152, seed=n)[0] for n in (64, 40, 40)]
    for m in (1, 3, 16, 17, 40):
        x = activations(m, 1152, seed=m)
        alone = []
        for n_threads in (1, 2, 3):
            mm.set_num_threads(n_threads)
            alone.append([run(x, w) for w in weights])
            outs = [np.full((m, w.n), np.nan, dtype=np.float32) for w in weights]
            mm.matmul_many(x, weights, outs)
            for a, b in zip(alone[0], outs):
                assert same_bits(a, b)
        for other in alone[1:]:
            for a, b in zip(alone[0], other):
                assert same_bits(a, b)


GGUF_KINDS = ("Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1")


@pytest.mark.parametrize("kind", GGUF_KINDS)
def test_gguf_blocks_read_as_integers_give_gguf_pys_values(kind: str) -> None:
    """The reference's reading of the blocks (A * w + B) is the blocks' values (as gguf-py de-quantizes them)."""
    rng = np.random.default_rng(5)
    k = 512
    raw = random_blocks(rng, gguf.GGMLQuantizationType[kind], 6, k)
    w, a, b = gguf_ints(kind, raw, k)
    values = a[..., None] * w.astype(np.float32) + (0 if b is None else b[..., None])
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(6, k // 32, 32)
    assert np.allclose(values, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("bits", (8, 16))
@pytest.mark.parametrize("n", (1, 8, 21))
@pytest.mark.parametrize("kind", GGUF_KINDS)
def test_gguf_blocks_on_the_integer_path_match_the_reference_bit_for_bit(kind: str, n: int, bits: int) -> None:
    rng = np.random.default_rng(n)
    for k in ((256, 768) if kind.endswith("_K") else (32, 96, 800)):
        raw = random_blocks(rng, gguf.GGMLQuantizationType[kind], n, k)
        weight = mm.Weight(kind, n, k, raw.reshape(-1), exact=False, act_bits=bits)
        assert weight.integer
        x = activations(max(M_VALUES), k, seed=k)
        want = integer_reference(x, *gguf_ints(kind, raw, k), bits=bits)
        for m in M_VALUES:
            assert same_bits(run(x[:m], weight), want[:m]), f"K={k} M={m}"


# ---- packed rows (matmul.h): base_q4 and K-quant weights on the integer path of the SIMD variants, eight rows
# interleaved ----

PACKED_KINDS = ("base_q4", "Q4_K", "Q5_K", "Q6_K")
PACKS = VARIANT != "portable"


def packed_layout(raw: np.ndarray, chunk: int) -> np.ndarray:
    """matmul.h's packed layout of rows raw [N, row bytes] in chunks of `chunk` bytes (a super-block; a base_q4 row),
    written with numpy: per group of eight rows and chunk, unit vector u of offset o holds bytes 16o + 4u .. + 4 of row
    r at 128o + 32u + 4r; the bytes past the last whole 16 follow row by row; the N % 8 last rows as they are."""
    n, row_bytes = raw.shape
    units, groups, per_row = chunk // 16 * 16, n // 8, row_bytes // chunk
    chunks = raw[:8 * groups].reshape(groups, 8, per_row, chunk)
    head = chunks[..., :units].reshape(groups, 8, per_row, units // 16, 4, 4).transpose(0, 2, 3, 4, 1, 5)
    tail = chunks[..., units:].transpose(0, 2, 1, 3)
    packed = np.concatenate([head.reshape(groups, per_row, -1), tail.reshape(groups, per_row, -1)], axis=2)
    return np.concatenate([packed.reshape(-1), raw[8 * groups:].reshape(-1)])


def packable(kind: str, n: int, k: int, seed: int, **options) -> tuple[mm.Weight, np.ndarray, tuple, np.ndarray]:
    """A weight of `kind`, its file's rows [N, row bytes], its integers (base_ints / gguf_ints) and its values."""
    if kind == "base_q4":
        weight, q, values = make((kind, 32, False, "f16"), n, k, seed)
        raw = np.asarray(q.packed).reshape(n, -1)
        weight = mm.Weight(kind, n, k, q.packed, q.scales, q.biases, 32, exact=False, **options)
        return weight, raw, base_ints(q), dequantize(q)
    qtype = gguf.GGMLQuantizationType[kind]
    raw = random_blocks(np.random.default_rng(seed), qtype, n, k)
    weight = mm.Weight(kind, n, k, raw.reshape(-1), exact=False, **options)
    return weight, raw, gguf_ints(kind, raw, k), gguf.quants.dequantize(raw, qtype).reshape(n, k)


@pytest.mark.parametrize("kind", PACKED_KINDS)
def test_weights_are_packed_once_where_the_byte_kernels_read_them(kind: str) -> None:
    for n in (8, 21, 40):
        released: list[tuple[int, int]] = []
        weight, raw, _, _ = packable(kind, n, 768, seed=n,
                                     release=lambda start, stop, into=released: into.append((start, stop)))
        assert weight.packed == PACKS
        if PACKS:
            chunk = raw.shape[1] if kind == "base_q4" else gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][1]
            assert np.array_equal(np.asarray(weight.data), packed_layout(raw, chunk))
            # The copied bytes handed back in order, every one of them once.
            ends = [0] + [stop for _, stop in released]
            assert [start for start, _ in released] == ends[:-1] and ends[-1] == raw.size
        else:
            assert released == [] and np.shares_memory(weight.data, raw)
    # The weights that read the file's layout: too few rows, the exact path.
    few, raw, _, _ = packable(kind, 7, 256, seed=1)
    assert not few.packed and not packable(kind, 8, 256, seed=1)[0].rows(0, 4).packed
    if kind != "base_q4":
        assert not mm.Weight(kind, 8, 256, random_blocks(np.random.default_rng(2), gguf.GGMLQuantizationType[kind], 8,
                                                         256).reshape(-1), exact=True).packed
    if PACKS:
        with pytest.raises(ValueError, match="not stored packed"):
            packable(kind, 7, 256, seed=1, packed=True)
    assert not mm.Weight("Q3_K", 8, 256, random_blocks(np.random.default_rng(3), gguf.GGMLQuantizationType.Q3_K, 8,
                                                       256).reshape(-1), exact=False).packed


@pytest.mark.parametrize("kind", PACKED_KINDS)
def test_packed_weights_read_as_the_file_stores_them(kind: str) -> None:
    """Rows of a packed weight, whole groups or cut anywhere (rows(): experts), and its embedding rows, give the bits of
    the file's rows."""
    n, k = 40, 768
    weight, _, ints, values = packable(kind, n, k, seed=4)
    x = activations(9, k, seed=8)
    want = integer_reference(x, *ints, bits=8)
    for start, stop in ((0, 8), (8, 24), (3, 11), (8, 21), (5, 40), (32, 40), (16, 40), (36, 40)):
        part = weight.rows(start, stop)
        # Whole groups keep the packed bytes; rows cut out of a group are copied back to the file's layout first.
        assert np.shares_memory(part.data, weight.data) == (not PACKS or (start % 8 == 0 and stop % 8 == 0))
        assert part.packed == (PACKS and stop - start >= 8)
        for m in (1, 4, 8, 9):
            assert same_bits(run(x[:m], part), want[:m, start:stop]), (start, stop, m)
    ids = np.array([0, 7, 8, 39, 21, 8], dtype=np.int32)
    out = np.zeros((ids.size, k), dtype=np.float32)
    mm.embed_rows(weight, ids, out)
    assert np.array_equal(out, values[ids])


def test_the_largest_block_sums_fit_in_32_bits() -> None:
    """Q6_K's largest integers (scale -128 times code 0 - 32 = 4096) against full-scale codes: the block sum
    32 * 4096 * 16383 is the largest the contract allows, and the kernels keep its sign."""
    k = 512
    raw = np.zeros((2, k // 256, 210), dtype=np.uint8)
    raw[..., 192:208] = np.uint8(0x80)  # every 16-value scale -128
    raw[..., 208:210] = np.frombuffer(np.float16(1).tobytes(), dtype=np.uint8)
    raw[1, :, 192:208] = np.uint8(0x7F)  # the second row: scale 127
    raw = raw.reshape(2, -1)
    weight = mm.Weight("Q6_K", 2, k, raw.reshape(-1), exact=False, act_bits=16)
    x = np.stack([np.ones(k, np.float32), -np.ones(k, np.float32)])
    want = integer_reference(x, *gguf_ints("Q6_K", raw, k), bits=16)
    assert same_bits(run(x, weight), want)
    assert np.allclose(want, [[4096 * k, -127 * 32 * k], [-4096 * k, 127 * 32 * k]], rtol=1e-6)


@pytest.mark.parametrize("bits", (8, 16))
@pytest.mark.parametrize("kind", ("Q4_K", "Q5_K", "Q6_K"))
def test_the_largest_sums_of_k_quants_keep_their_sign(kind: str, bits: int) -> None:
    """Every code at its largest (Q6_K: 63, with scales -128 and 127) against full-scale activations of either sign
    (16-bit codes of -16383 have the byte plane hi = -128): the kernels that add products in 16 bits before widening
    them must neither saturate nor wrap."""
    k, n = 512, 16
    size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][1]
    raw = np.full((n, k // 256, size), 0xFF, dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    if kind == "Q6_K":
        raw[..., 208:210] = scale
        raw[::2, :, 192:208] = np.uint8(0x80)  # every 16-value scale -128 on even rows, 127 on odd ones
        raw[1::2, :, 192:208] = np.uint8(0x7F)
    else:
        raw[..., 0:2] = scale
        raw[..., 2:4] = scale
    raw = raw.reshape(n, -1)
    weight = mm.Weight(kind, n, k, raw.reshape(-1), exact=False, act_bits=bits)
    x = np.stack([np.ones(k, np.float32), -np.ones(k, np.float32), np.tile([1, -1], k // 2).astype(np.float32)])
    want = integer_reference(x, *gguf_ints(kind, raw, k), bits=bits)
    for m in (1, 2, 3):
        assert same_bits(run(x[:m], weight), want[:m]), f"M={m}"
    assert np.all(want[0] != 0) and np.all(np.sign(want[0]) == -np.sign(want[1]))


def test_fused_call_mixes_integer_and_float_weights() -> None:
    case = ("base_q4", 32, False, "f16")
    integer, q, values = make(case, 48, 576, seed=1)
    exact = mm.Weight("base_q4", 48, 576, q.packed, q.scales, q.biases, 32, "f16", exact=True)
    dense = mm.Weight("f32", 24, 576, np.ascontiguousarray(values[:24]).reshape(-1).view(np.uint8))
    for m in (2, 40):
        x = activations(m, 576, seed=m)
        outs = [np.full((m, w.n), np.nan, dtype=np.float32) for w in (integer, exact, dense)]
        mm.matmul_many(x, [integer, exact, dense], outs)
        for w, out in zip((integer, exact, dense), outs):
            assert same_bits(out, run(x, w))


@pytest.mark.parametrize("case", [c for c in KINDS if c[3] == "f16"], ids=kind_id)
@pytest.mark.parametrize("bits", (8, 16))
def test_integer_path_stays_close_to_the_exact_path(case: tuple[str, int, bool, str], bits: int) -> None:
    weight, q, _ = make(case, 96, 1152 if case[1] == 128 else 576, seed=3, bits=bits)
    exact = mm.Weight(q.dtype, weight.n, weight.k, q.packed, q.scales, q.biases, q.group_size, q.scale_dtype,
                      exact=True)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((8, weight.k), dtype=np.float32)
    fast, slow = run(x, weight), run(x, exact)
    # An error of about half a code (1/254 of each block's largest value with 8 bits, 1/32766 with 16) on each
    # product, across the row.
    error = np.abs(fast - slow).max() / np.abs(slow).max()
    assert error < {8: 0.05, 16: 0.001}[bits], error


def test_which_weights_take_the_integer_path() -> None:
    rng = np.random.default_rng(0)
    values = rng.standard_normal((8, 64), dtype=np.float32)
    q = quantize(values, "base_q4", 32)
    assert mm.Weight("base_q4", 8, 64, q.packed, q.scales, q.biases, 32, exact=False).integer
    assert not mm.Weight("base_q4", 8, 64, q.packed, q.scales, q.biases, 32, exact=True).integer
    q16 = quantize(values, "base_q8", 16)
    assert not mm.Weight("base_q8", 8, 64, q16.packed, q16.scales, q16.biases, 16, exact=False).integer
    dense = mm.Weight("f32", 8, 64, values.reshape(-1).view(np.uint8), exact=False)
    assert not dense.integer
    weight = mm.Weight("base_q4", 8, 64, q.packed, q.scales, q.biases, 32, exact=False)
    assert weight.rows(0, 4).integer and not mm.Weight("base_q4", 8, 64, q.packed, q.scales, q.biases, 32,
                                                    exact=True).rows(0, 4).integer
    before = mm.get_exact()
    try:
        mm.set_exact(True)
        assert not mm.Weight("base_q4", 8, 64, q.packed, q.scales, q.biases, 32).integer
        mm.set_exact(False)
        assert mm.Weight("base_q4", 8, 64, q.packed, q.scales, q.biases, 32).integer
    finally:
        mm.set_exact(before)


def test_quantized_rows_need_whole_blocks_and_8_or_16_bits() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        mm.QuantizedRows(np.zeros((2, 48), dtype=np.float32))
    with pytest.raises(ValueError, match="8 or 16 bits, not 12"):
        mm.QuantizedRows(np.zeros((2, 64), dtype=np.float32), 12)


def test_weights_that_share_an_input_share_its_activation_bits() -> None:
    """matmul_many quantizes its input once: integer weights of different act_bits cannot share it."""
    case = ("base_q4", 32, False, "f16")
    eight, sixteen = make(case, 16, 64, seed=1)[0], make(case, 16, 64, seed=2, bits=16)[0]
    x = activations(2, 64, seed=5)
    outs = [np.zeros((2, 16), dtype=np.float32) for _ in range(2)]
    with pytest.raises(ValueError, match="share their input's activation bits"):
        mm.matmul_many(x, [eight, sixteen], outs)
    assert eight.act_bits == 8 and sixteen.act_bits == 16 and sixteen.rows(0, 8).act_bits == 16
    with pytest.raises(ValueError, match="8 or 16 bits"):
        eight.act_bits = 4


def test_the_lm_head_alone_takes_16_bit_activations(smollm2_base) -> None:
    """The models' choice (basert/models/transformer.py): 8-bit activations into every quantized weight, 16-bit into
    the LM head, and the arithmetic named in the fingerprint that caches and saved slots carry."""
    from basert.engine.runner import ModelRunner, model_fingerprint
    from basert.models.transformer import HEAD_ACT_BITS, INTEGER_ARITHMETIC

    runner = ModelRunner(smollm2_base, max_context=64)
    try:
        assert HEAD_ACT_BITS == 16 and runner.model.head.integer and runner.model.head.act_bits == 16
        layer = runner.model.layers[0]
        weights = [layer.mixer.q_proj.weight, layer.mixer.o_proj.weight, layer.feed_forward.down_proj.weight]
        assert all(w.integer and w.act_bits == 8 for w in weights)
        assert runner.fingerprint == f"{model_fingerprint(smollm2_base)}-{INTEGER_ARITHMETIC}"
    finally:
        runner.close()
