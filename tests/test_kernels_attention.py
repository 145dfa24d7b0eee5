"""Paged KV cache writes and causal GQA attention (basert._ext.attention) against a float64 numpy
reference, for every KV type (and K and V of different types), plus bit-identical results however a prompt is
split; the stored bytes of every type against its numpy reference (basert._ext.kvtypes)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from basert._ext import attention as attn
from basert._ext import matmul
from basert._ext.kvtypes import KV_TYPES, decode, encode, hadamard, kv_type

BLOCK = 16


def f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


def attention_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, start_pos: int, scale: float,
                        window: int = 0) -> np.ndarray:
    """q [T, H, d]; k, v [n_pos, H_kv, d] for every position; token t sees positions 0 .. start_pos + t (the
    last `window` of them when window > 0)."""
    T, H, d = q.shape
    group = H // k.shape[1]
    out = np.empty((T, H, d))
    for t in range(T):
        n = start_pos + t + 1
        first = max(0, n - window) if window else 0
        for h in range(H):
            scores = k[first:n, h // group].astype(np.float64) @ q[t, h].astype(np.float64) * scale
            p = np.exp(scores - scores.max())
            out[t, h] = (p / p.sum()) @ v[first:n, h // group].astype(np.float64)
    return out


# Every KV type for K and V alike, and K and V of different types.
KV = [*KV_TYPES, "q8_0/f16", "f16/q8_0", "bf16/f32"]


def kv_names(kv: str) -> tuple[str, str]:
    """The K and the V type of a KV parameter ("q8_0", or "q8_0/f16" for K q8_0 and V f16)."""
    k, _, v = kv.partition("/")
    return k, v or k


def new_cache(n_blocks: int, n_kv: int, d: int, kv: str) -> tuple[np.ndarray, np.ndarray]:
    """Zeroed K and V caches of the types of `kv`; the test is skipped where a type cannot hold rows of d values."""
    caches = []
    for name in kv_names(kv):
        kind = kv_type(name)
        if not kind.supports(d):
            pytest.skip(f"{name} rows need a head dim that is a multiple of 32, not {d}")
        caches.append(np.zeros((n_blocks, n_kv, BLOCK, kind.row_units(d)), dtype=kind.storage))
    return caches[0], caches[1]


def stored(x: np.ndarray, name: str) -> np.ndarray:
    """What attention meets for rows x in a cache of type `name` (the reference's view of the cache): the floats the
    rows read back as, turned back where they were turned (q8_0: a query meets them turned, a weighted sum of them is
    turned back)."""
    kind = kv_type(name)
    values = decode(kind, encode(kind, x), x.shape[-1])
    return hadamard(values, 1 / 32) if kind.turned else values


def shuffled_blocks(rng: np.random.Generator, n_pos: int, n_blocks: int) -> np.ndarray:
    """A block table for n_pos positions using non-contiguous, shuffled block ids."""
    return rng.permutation(n_blocks)[: -(-n_pos // BLOCK)].astype(np.int32)


def gather(cache: np.ndarray, block_table: np.ndarray, n_pos: int) -> np.ndarray:
    """[n_pos, H_kv, d] view of the positions stored in a paged cache."""
    p = np.arange(n_pos)
    return cache[block_table[p // BLOCK], :, p % BLOCK, :]


def run_chunks(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, chunks: list[int], block_table: np.ndarray, n_blocks: int, kv: str
) -> np.ndarray:
    """Writes and attends a prompt chunk by chunk into fresh caches; returns the outputs of all tokens."""
    k_cache, v_cache = new_cache(n_blocks, k.shape[1], k.shape[2], kv)
    outs, pos = [], 0
    for n in chunks:
        sl = slice(pos, pos + n)
        attn.kv_write(k_cache, v_cache, f32(k[sl]), f32(v[sl]), block_table, pos)
        out = np.empty_like(q[sl])
        attn.attention(f32(q[sl]), k_cache, v_cache, block_table, pos, 0.125, out)
        outs.append(out)
        pos += n
    return np.concatenate(outs)


@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize(
    "T,H,n_kv,d,start_pos",
    [(1, 4, 2, 32, 0), (3, 9, 3, 64, 5), (17, 4, 2, 24, 40), (70, 9, 3, 64, 0), (5, 6, 6, 20, 33), (1, 4, 1, 13, 100),
     (33, 8, 2, 128, 250), (40, 4, 4, 72, 9), (2, 4, 2, 256, 61)],
)
def test_attention_matches_reference(T: int, H: int, n_kv: int, d: int, start_pos: int, kv: str) -> None:
    rng = np.random.default_rng(T * 1000 + H * 100 + d + start_pos)
    n_pos = start_pos + T
    q = f32(rng.standard_normal((T, H, d)))
    k = f32(rng.standard_normal((n_pos, n_kv, d)) * 2)
    v = f32(rng.standard_normal((n_pos, n_kv, d)))
    n_blocks = -(-n_pos // BLOCK) + 5
    block_table = shuffled_blocks(rng, n_pos, n_blocks)
    k_cache, v_cache = new_cache(n_blocks, n_kv, d, kv)
    if start_pos:
        attn.kv_write(k_cache, v_cache, k[:start_pos], v[:start_pos], block_table, 0)
    attn.kv_write(k_cache, v_cache, f32(k[start_pos:]), f32(v[start_pos:]), block_table, start_pos)
    out = np.empty_like(q)
    scale = d**-0.5
    attn.attention(q, k_cache, v_cache, block_table, start_pos, scale, out)
    # The reference sees what the cache holds: values rounded to float16 for a float16 cache, and so on.
    stored_k, stored_v = stored(k, kv_names(kv)[0]), stored(v, kv_names(kv)[1])
    np.testing.assert_allclose(out, attention_reference(q, stored_k, stored_v, start_pos, scale), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("d", [7, 16, 20, 64])
def test_kv_write_stores_each_position_in_its_block_slot(kv: str, d: int) -> None:
    rng = np.random.default_rng(d)
    n_kv, start_pos, T = 3, 13, 22
    # Half-precision edge cases: subnormals, a rounding tie, the largest half, overflow to inf; a bfloat16 tie.
    special = np.array([6e-8, -3e-6, 1 + 2**-11, 65504.0, 65519.0, 65520.0, -1e6, 0.0, 1 + 2**-8], dtype=np.float32)
    k = f32(rng.standard_normal((T, n_kv, d)))
    k.reshape(-1)[: special.size] = special
    k[1, 1, :32] = 0.0  # an all-zero block of 32 (a q8_0 scale of 0)
    v = f32(rng.standard_normal((T, n_kv, d)))
    block_table = np.array([4, 0, 2, 6], dtype=np.int32)
    k_cache, v_cache = new_cache(7, n_kv, d, kv)
    attn.kv_write(k_cache, v_cache, k, v, block_table, start_pos)
    k_name, v_name = kv_names(kv)
    assert np.array_equal(gather(k_cache, block_table, start_pos + T)[start_pos:], encode(kv_type(k_name), k))
    assert np.array_equal(gather(v_cache, block_table, start_pos + T)[start_pos:], encode(kv_type(v_name), v))
    # Nothing else was touched: earlier slots of block 4, and blocks outside the table.
    assert not gather(k_cache, block_table, start_pos).any()
    assert not k_cache[[1, 3, 5]].any() and not v_cache[[1, 3, 5]].any()


@pytest.mark.parametrize("kv", KV)
def test_attention_is_bit_identical_however_the_prompt_is_split(kv: str) -> None:
    rng = np.random.default_rng(70)
    n, H, n_kv, d = 70, 9, 3, 64
    q, k, v = (f32(rng.standard_normal((n, h, d))) for h in (H, n_kv, n_kv))
    whole = run_chunks(q, k, v, [70], shuffled_blocks(rng, n, 12), 12, kv)
    assert np.array_equal(run_chunks(q, k, v, [33, 37], shuffled_blocks(rng, n, 12), 12, kv), whole)
    assert np.array_equal(run_chunks(q, k, v, [1] * 70, shuffled_blocks(rng, n, 12), 12, kv), whole)
    assert np.array_equal(run_chunks(q, k, v, [5, 1, 64], np.arange(5, dtype=np.int32), 5, kv), whole)


@pytest.mark.parametrize("kv", KV)
def test_sequences_batched_in_one_call_equal_each_alone(kv: str) -> None:
    """Decode rows and prefill chunks of different sequences, in one call, give each one's own bits."""
    rng = np.random.default_rng(71)
    H, n_kv, d, n_blocks = 6, 2, 16, 40
    k_cache, v_cache = new_cache(n_blocks, n_kv, d, kv)
    # (tokens already cached, new tokens) per sequence, each with its own blocks.
    shapes = [(0, 21), (37, 1), (16, 5), (50, 1)]
    tables = np.zeros((len(shapes), 5), dtype=np.int32)
    blocks = rng.permutation(n_blocks).astype(np.int32)
    for i in range(len(shapes)):
        tables[i] = blocks[5 * i: 5 * i + 5]
    new = []
    for i, (cached, n_new) in enumerate(shapes):
        total = cached + n_new
        k, v = (f32(rng.standard_normal((total, n_kv, d))) for _ in range(2))
        if cached:
            attn.kv_write(k_cache, v_cache, k[:cached], v[:cached], tables[i], 0)
        new.append((f32(rng.standard_normal((n_new, H, d))), k[cached:], v[cached:]))
    rows = np.cumsum([0] + [n for _, n in shapes[:-1]]).astype(np.int32)
    lengths = np.array([n for _, n in shapes], dtype=np.int32)
    starts = np.array([c for c, _ in shapes], dtype=np.int32)
    q_all, k_all, v_all = (np.concatenate([part[j] for part in new]) for j in range(3))
    batch_k, batch_v = k_cache.copy(), v_cache.copy()
    attn.kv_write_batch(batch_k, batch_v, k_all, v_all, tables, rows, lengths, starts)
    together = np.zeros_like(q_all)
    attn.attention_batch(q_all, batch_k, batch_v, tables, rows, lengths, starts, 0.25, together)
    for i, (q, k, v) in enumerate(new):
        attn.kv_write(k_cache, v_cache, k, v, tables[i], int(starts[i]))
        alone = np.zeros_like(q)
        attn.attention(q, k_cache, v_cache, tables[i], int(starts[i]), 0.25, alone)
        assert np.array_equal(together[rows[i]: rows[i] + lengths[i]], alone), f"sequence {i}"
    assert np.array_equal(batch_k, k_cache) and np.array_equal(batch_v, v_cache)


def test_softmax_subtracts_the_max() -> None:
    # Scores of several thousand would overflow exp without the shift; the top key must win outright.
    d, n_pos = 32, 40
    rng = np.random.default_rng(3)
    k = f32(rng.standard_normal((n_pos, 1, d)))
    v = f32(rng.standard_normal((n_pos, 1, d)))
    q = f32(k[17:18] * 1000)
    k_cache, v_cache = new_cache(3, 1, d, "f32")
    table = np.array([2, 0, 1], dtype=np.int32)
    attn.kv_write(k_cache, v_cache, k, v, table, 0)
    out = np.empty_like(q)
    attn.attention(q, k_cache, v_cache, table, n_pos - 1, 1.0, out)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[0, 0], v[17, 0], rtol=1e-6, atol=1e-6)


def test_kernels_reject_bad_tables_shapes_and_caches() -> None:
    k_cache, v_cache = new_cache(4, 2, 8, "f32")
    kv = np.zeros((3, 2, 8), dtype=np.float32)
    q, out = np.zeros((3, 4, 8), dtype=np.float32), np.zeros((3, 4, 8), dtype=np.float32)
    table = np.array([0, 1], dtype=np.int32)
    with pytest.raises(ValueError, match="block table has 2 blocks, 35 positions need 3"):
        attn.kv_write(k_cache, v_cache, kv, kv, table, 32)
    with pytest.raises(ValueError, match="block table has 2 blocks, 35 positions need 3"):
        attn.attention(q, k_cache, v_cache, table, 32, 1.0, out)
    for bad in (4, -1):
        with pytest.raises(ValueError, match=f"block table entry 1 is {bad}, the cache has 4 blocks"):
            attn.attention(q, k_cache, v_cache, np.array([0, bad], dtype=np.int32), 14, 1.0, out)
    with pytest.raises(ValueError, match="cannot share"):
        attn.attention(np.zeros((3, 3, 8), np.float32), k_cache, v_cache, table, 0, 1.0, np.zeros_like(out[:, :3]))
    with pytest.raises(ValueError, match="4 query heads cannot share 0 kv heads"):
        attn.attention(q, *new_cache(4, 0, 8, "f32"), table, 0, 1.0, out)
    with pytest.raises(ValueError, match="head dim"):
        attn.attention(np.zeros((3, 4, 4), np.float32), k_cache, v_cache, table, 0, 1.0, np.zeros_like(out[..., :4]))
    with pytest.raises(ValueError, match="out must have the shape of q"):
        attn.attention(q, k_cache, v_cache, table, 0, 1.0, np.zeros((2, 4, 8), np.float32))
    with pytest.raises(ValueError, match="the cache has"):
        attn.kv_write(k_cache, v_cache, np.zeros((3, 1, 8), np.float32), np.zeros((3, 1, 8), np.float32), table, 0)
    with pytest.raises(ValueError, match="start_pos"):
        attn.kv_write(k_cache, v_cache, kv, kv, table, -1)
    with pytest.raises(ValueError, match="must be float32, float16, uint16 .bf16. or uint8 .q8_0."):
        attn.attention(q, k_cache.astype(np.float64), v_cache.astype(np.float64), table, 0, 1.0, out)
    with pytest.raises(ValueError, match="q8_0 rows need a head dim that is a multiple of 32, not 8"):
        attn.kv_write(k_cache, np.zeros((4, 2, BLOCK, 8), np.uint8), kv, kv, table, 0)
    with pytest.raises(ValueError, match="a f16 cache of head dim 8 has rows of 8 elements, not 4"):
        attn.kv_write(k_cache, np.zeros((4, 2, BLOCK, 4), np.float16), kv, kv, table, 0)
    with pytest.raises(ValueError, match="shape"):
        attn.attention(q, k_cache[:, :, :8], v_cache[:, :, :8], table, 0, 1.0, out)
    with pytest.raises(ValueError, match="C-contiguous"):
        attn.attention(q, k_cache[::2], v_cache[::2], table, 0, 1.0, out)
    k_cache.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        attn.kv_write(k_cache, v_cache, kv, kv, table, 0)
    attn.attention(q, k_cache, v_cache, table, 0, 1.0, out)


SEG = attn.SEGMENT


@contextmanager
def threads(n: int) -> Iterator[None]:
    """The kernels run on n OpenMP threads inside the block."""
    before = matmul.get_num_threads()
    matmul.set_num_threads(n)
    try:
        yield
    finally:
        matmul.set_num_threads(before)


def as_bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def test_segment_is_a_multiple_of_the_cache_block() -> None:
    assert SEG > 0 and SEG % BLOCK == 0


def check_batch_against_reference(rng: np.random.Generator, shapes: list[tuple[int, int]], H: int, n_kv: int, d: int,
                                  kv: str, scale: float, window: int = 0) -> None:
    """Sequences of (cached, new) positions in one attention_batch call (2 threads), each against the reference."""
    per_seq = -(-max(c + n for c, n in shapes) // BLOCK)
    n_blocks = len(shapes) * per_seq + 2
    tables = rng.permutation(n_blocks)[: len(shapes) * per_seq].astype(np.int32).reshape(len(shapes), per_seq)
    k_cache, v_cache = new_cache(n_blocks, n_kv, d, kv)
    seqs = []
    for i, (cached, n_new) in enumerate(shapes):
        k, v = (f32(rng.standard_normal((cached + n_new, n_kv, d)) * s) for s in (2, 1))
        attn.kv_write(k_cache, v_cache, k, v, tables[i], 0)
        seqs.append((f32(rng.standard_normal((n_new, H, d))), k, v))
    q = np.concatenate([s[0] for s in seqs])
    lengths = np.array([n_new for _, n_new in shapes], dtype=np.int32)
    rows = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int32)
    starts = np.array([cached for cached, _ in shapes], dtype=np.int32)
    out = np.zeros_like(q)
    with threads(2):
        attn.attention_batch(q, k_cache, v_cache, tables, rows, lengths, starts, scale, out, window)
    for i, (qi, k, v) in enumerate(seqs):
        k_name, v_name = kv_names(kv)
        expected = attention_reference(qi, stored(k, k_name), stored(v, v_name), int(starts[i]), scale, window)
        np.testing.assert_allclose(out[rows[i]: rows[i] + lengths[i]], expected, rtol=1e-5, atol=1e-6,
                                   err_msg=f"sequence {i}")


@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("n", [1, 15, 16, 17, SEG - 1, SEG, SEG + 1, 3 * SEG + 5, 4096])
@pytest.mark.parametrize("H,n_kv,d", [(9, 3, 64), (4, 1, 20), (20, 1, 16)])
def test_contexts_around_the_segment_length_match_reference(n: int, H: int, n_kv: int, d: int, kv: str) -> None:
    """Three sequences in one call: the last tokens of an n-position prompt, a decode at n, one at n // 2 + 1."""
    rng = np.random.default_rng(n * 31 + H + d)
    check_batch_against_reference(rng, [(max(0, n - 3), min(n, 3)), (n - 1, 1), (n // 2, 1)], H, n_kv, d, kv,
                                  d**-0.5)


@pytest.mark.parametrize("kv", KV)
def test_long_rows_are_bit_identical_however_they_are_computed(kv: str) -> None:
    """Whole prompt, token by token (decode: segments of one row spread over threads, then merged),
    random chunks, 1 or 2 threads: every token's output has the same bits."""
    rng = np.random.default_rng(72)
    n, H, n_kv, d = 3 * SEG + 5, 9, 3, 64
    q, k, v = (f32(rng.standard_normal((n, h, d))) for h in (H, n_kv, n_kv))
    n_blocks = -(-n // BLOCK) + 3
    with threads(2):
        whole = run_chunks(q, k, v, [n], shuffled_blocks(rng, n, n_blocks), n_blocks, kv)
        assert np.array_equal(as_bits(run_chunks(q, k, v, [1] * n, shuffled_blocks(rng, n, n_blocks), n_blocks, kv)),
                              as_bits(whole))
        cuts = np.sort(rng.choice(np.arange(1, n), size=6, replace=False))
        chunks = np.diff(np.concatenate([[0], cuts, [n]])).tolist()
        assert np.array_equal(as_bits(run_chunks(q, k, v, chunks, shuffled_blocks(rng, n, n_blocks), n_blocks, kv)),
                              as_bits(whole))
    with threads(1):
        for split in ([n], [n - 40] + [1] * 40):
            got = run_chunks(q, k, v, split, shuffled_blocks(rng, n, n_blocks), n_blocks, kv)
            assert np.array_equal(as_bits(got), as_bits(whole)), split


@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("n_threads", [1, 2])
def test_a_long_decode_row_has_its_bits_in_any_batch(kv: str, n_threads: int) -> None:
    """A decode row at depth 2S + 9 alone, beside other decodes, beside a long prefill chunk (so the call
    no longer splits rows into segments), and among many sequences."""
    rng = np.random.default_rng(73)
    H, n_kv, d = 9, 3, 64
    depths = [2 * SEG + 9, 5, SEG + 1, 3 * SEG, 40, 2 * SEG + 9]
    per_seq = -(-(3 * SEG + 1) // BLOCK)
    n_blocks = per_seq * len(depths)
    tables = rng.permutation(n_blocks).astype(np.int32).reshape(len(depths), per_seq)
    k_cache, v_cache = new_cache(n_blocks, n_kv, d, kv)
    for i, depth in enumerate(depths):
        k, v = (f32(rng.standard_normal((depth + 1, n_kv, d))) for _ in range(2))
        attn.kv_write(k_cache, v_cache, k, v, tables[i], 0)
    q = f32(rng.standard_normal((len(depths), H, d)))
    prefill = f32(rng.standard_normal((40, H, d)))

    def run(members: list[int], prefill_rows: int = 0) -> np.ndarray:
        """Decode rows of the given sequences (then prefill_rows of sequence 3's prompt end) in one call."""
        qs = [q[i: i + 1] for i in members]
        lengths = [1] * len(members)
        starts = [depths[i] for i in members]
        table = [tables[i] for i in members]
        if prefill_rows:
            qs.append(prefill[:prefill_rows])
            lengths.append(prefill_rows)
            starts.append(depths[3] + 1 - prefill_rows)
            table.append(tables[3])
        q_all = np.concatenate(qs)
        out = np.zeros_like(q_all)
        lengths_arr = np.array(lengths, dtype=np.int32)
        rows = np.concatenate([[0], np.cumsum(lengths_arr)[:-1]]).astype(np.int32)
        attn.attention_batch(q_all, k_cache, v_cache, np.stack(table), rows, lengths_arr,
                             np.array(starts, dtype=np.int32), 0.125, out)
        return out

    with threads(n_threads):
        alone = run([0])[0]
        for members, prefill_rows in (([1, 0, 2], 0), ([0], 40), ([4, 2, 0, 1], 7), ([5, 0, 1, 2, 3, 4], 0)):
            together = run(members, prefill_rows)
            assert np.array_equal(as_bits(together[members.index(0)]), as_bits(alone)), members
    with threads(3 - n_threads):
        assert np.array_equal(as_bits(run([0])[0]), as_bits(alone))
    # Sequences 0 and 5 hold different keys at the same depth: equal bits here would mean a mix-up.
    assert not np.array_equal(run([5])[0], alone)


@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("n", [7, SEG, SEG + 1, 3 * SEG + 5])
def test_segment_partials_merged_in_order_give_the_output(n: int, kv: str) -> None:
    """The executor's building blocks: partials of each segment (computed beside other rows of the kv head,
    which end earlier or later), merged in segment order, equal attention's output bit for bit; a single
    segment is acc * (1 / sum) exactly, today's arithmetic."""
    rng = np.random.default_rng(n)
    n_kv, d, kv_head = 2, 32, 1
    q = f32(rng.standard_normal((4, d)))
    k, v = (f32(rng.standard_normal((n + 300, n_kv, d))) for _ in range(2))
    n_blocks = -(-(n + 300) // BLOCK)
    table = shuffled_blocks(rng, n + 300, n_blocks)
    k_cache, v_cache = new_cache(n_blocks, n_kv, d, kv)
    attn.kv_write(k_cache, v_cache, k, v, table, 0)
    # The row's output from attention: query head kv_head of one token at position n - 1 (one kv head per head).
    q_heads = np.zeros((1, n_kv, d), dtype=np.float32)
    q_heads[0, kv_head] = q[0]
    out = np.empty_like(q_heads)
    attn.attention(q_heads, k_cache, v_cache, table, n - 1, 0.2, out)
    n_pos = np.array([n, 3, n + 300, max(1, n - 20)], dtype=np.intp)
    parts = [attn.segment_partials(q, k_cache, v_cache, kv_head, table, n_pos, p0, min(p0 + SEG, int(n_pos.max())), 0.2)
             for p0 in range(0, n, SEG)]
    alone = [attn.segment_partials(q[:1], k_cache, v_cache, kv_head, table, n_pos[:1], p0, min(p0 + SEG, n), 0.2)
             for p0 in range(0, n, SEG)]
    top, total, acc = (np.array([p[j][0] for p in parts]) for j in range(3))
    for j in range(3):
        assert np.array_equal(as_bits(np.array([p[j][0] for p in alone])), as_bits([p[j][0] for p in parts]))
    merged = attn.merge_partials(f32(top), f32(total), f32(acc))
    assert np.array_equal(as_bits(merged), as_bits(out[0, kv_head]))
    if n <= SEG:
        assert np.array_equal(as_bits(acc[0] * (np.float32(1) / total[0])), as_bits(out[0, kv_head]))
    # Row 1 ends at position 3: segments after the first leave its partials untouched.
    assert all(np.isnan(p[0][1]) for p in parts[1:])
    assert np.isfinite(parts[0][2][1]).all()


@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("window", [1, 5, 16, 100, SEG, SEG + 9, 512])
def test_sliding_window_matches_reference(window: int, kv: str) -> None:
    """Three sequences in one call (a prefill chunk crossing several segments, a deep decode, a short one):
    each token sees only the last `window` positions, itself included."""
    check_batch_against_reference(np.random.default_rng(window), [(300, 500), (1400, 1), (3, 1)], 4, 1, 32, kv,
                                  0.2, window)


@pytest.mark.parametrize("kv", KV)
def test_sliding_window_rows_are_bit_identical_however_they_are_computed(kv: str) -> None:
    """With a window, as without: whole prompt, token by token (decode rows split into segments over the
    threads), random chunks, 1 or 2 threads give every token the same bits; and the window changes them."""
    rng = np.random.default_rng(74)
    n, H, n_kv, d, window = 3 * SEG + 5, 4, 1, 64, SEG + 40
    q, k, v = (f32(rng.standard_normal((n, h, d))) for h in (H, n_kv, n_kv))
    n_blocks = -(-n // BLOCK) + 3

    def run(chunks: list[int]) -> np.ndarray:
        table = shuffled_blocks(rng, n, n_blocks)
        k_cache, v_cache = new_cache(n_blocks, n_kv, d, kv)
        outs, pos = [], 0
        for size in chunks:
            sl = slice(pos, pos + size)
            attn.kv_write(k_cache, v_cache, f32(k[sl]), f32(v[sl]), table, pos)
            out = np.empty_like(q[sl])
            attn.attention_batch(f32(q[sl]), k_cache, v_cache, table[None, :], np.zeros(1, dtype=np.int32),
                                 np.array([size], dtype=np.int32), np.array([pos], dtype=np.int32), 0.125, out,
                                 window)
            outs.append(out)
            pos += size
        return np.concatenate(outs)

    with threads(2):
        whole = run([n])
        assert np.array_equal(as_bits(run([1] * n)), as_bits(whole))
        cuts = np.sort(rng.choice(np.arange(1, n), size=6, replace=False))
        assert np.array_equal(as_bits(run(np.diff(np.concatenate([[0], cuts, [n]])).tolist())), as_bits(whole))
    with threads(1):
        assert np.array_equal(as_bits(run([n - 40] + [1] * 40)), as_bits(whole))
    unwindowed = run_chunks(q, k, v, [n], shuffled_blocks(rng, n, n_blocks), n_blocks, kv)
    assert np.array_equal(as_bits(unwindowed[:window]), as_bits(whole[:window]))
    assert not np.array_equal(unwindowed[window:], whole[window:])


@pytest.mark.parametrize("n", [SEG - 10, SEG + 30, 3 * SEG + 5])
def test_windowed_segment_partials_merge_from_the_first_segment_of_the_window(n: int) -> None:
    """segment_partials with a window: segments wholly before a row's window leave it untouched, and folding
    the rest in order from the segment holding its first position gives attention's output."""
    rng = np.random.default_rng(n + 1)
    n_kv, d, window = 1, 32, SEG - 20
    q = f32(rng.standard_normal((2, d)))
    k, v = (f32(rng.standard_normal((n, n_kv, d))) for _ in range(2))
    n_blocks = -(-n // BLOCK)
    table = shuffled_blocks(rng, n, n_blocks)
    k_cache, v_cache = new_cache(n_blocks, n_kv, d, "f32")
    attn.kv_write(k_cache, v_cache, k, v, table, 0)
    out = np.empty((1, 1, d), dtype=np.float32)
    attn.attention_batch(q[:1, None, :], k_cache, v_cache, table[None, :], np.zeros(1, dtype=np.int32),
                         np.ones(1, dtype=np.int32), np.array([n - 1], dtype=np.int32), 0.2, out, window)
    n_pos = np.array([n, 40], dtype=np.intp)
    parts = [attn.segment_partials(q, k_cache, v_cache, 0, table, n_pos, p0, min(p0 + SEG, n), 0.2, window)
             for p0 in range(0, n, SEG)]
    first = max(0, n - window) // SEG
    assert all(np.isnan(p[0][0]) for p in parts[:first])
    top, total, acc = (np.array([p[j][0] for p in parts[first:]]) for j in range(3))
    merged = attn.merge_partials(f32(top), f32(total), f32(acc))
    assert np.array_equal(as_bits(merged), as_bits(out[0, 0]))
    np.testing.assert_allclose(merged, attention_reference(q[:1, None, :], k, v, n - 1, 0.2, window)[0, 0],
                               rtol=1e-5, atol=1e-6)


def test_a_negative_window_is_refused() -> None:
    q = np.zeros((1, 1, 16), dtype=np.float32)
    k_cache, v_cache = new_cache(1, 1, 16, "f32")
    with pytest.raises(ValueError, match="window must be >= 0"):
        attn.attention_batch(q, k_cache, v_cache, np.zeros((1, 1), dtype=np.int32), np.zeros(1, dtype=np.int32),
                             np.ones(1, dtype=np.int32), np.zeros(1, dtype=np.int32), 0.25, np.empty_like(q), -1)
