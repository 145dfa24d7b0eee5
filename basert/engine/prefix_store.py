"""Prefix cache files: one model's cached blocks (keys, tokens, KV) and hybrid snapshots, in one file.

Layout (little-endian): magic `BPXC`, u32 version (1), u32 header length, UTF-8 JSON header (block size,
model fingerprint, block and snapshot counts, KV element type and shapes), then u64 keys[n], u64
parents[n], int32 tokens[n, block size], per attention layer K then V as [n, n_kv_heads, block size,
head_dim], then u64 snapshot keys[m] and the float32 conv [m, ...] and ssm [m, ...] states.

The file sits beside the configured path as `PATH.<model id with "/" replaced by "--">`. It is written
atomically; a load first removes the temp files of killed saves, then validates every length, the
fingerprint and every key before touching the pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from basert.engine.kv import BLOCK_SIZE
from basert.engine.prefix_cache import PrefixCache
from basert.engine.runner import ModelRunner
from basert.engine.sequence import RecurrentState
from basert.format.atomic import atomic_file, remove_stale_temp_files, storage_errors
from basert.format.framed import read_frame, write_frame

MAGIC = b"BPXC"
VERSION = 1


class PrefixCacheFileError(ValueError):
    """A prefix cache file cannot be loaded into this model: the message says why."""


def prefix_cache_file(base: Path, model_id: str) -> Path:
    """`base.<model id>`, one flat file beside `base` ("/" in the id becomes "--")."""
    return base.with_name(f"{base.name}.{model_id.replace('/', '--')}")


def _layout(runner: ModelRunner, recurrent: RecurrentState | None) -> dict:
    return {
        "block_size": BLOCK_SIZE,
        "fingerprint": runner.fingerprint,
        "kv_dtype": str(runner.kv.dtype),
        "n_attention_layers": runner.n_attention_layers,
        "n_kv_heads": runner.config["num_key_value_heads"],
        "head_dim": runner.config["head_dim"],
        "conv_shape": list(recurrent.conv.shape) if recurrent is not None else None,
        "ssm_shape": list(recurrent.ssm.shape) if recurrent is not None else None,
    }


def save_prefix_cache(runner: ModelRunner, cache: PrefixCache, path: Path) -> int:
    """Write every cached block and snapshot to `path` atomically; the number of blocks written.

    A disk error raises StorageError and leaves the previous file as it was.
    """
    entries = list(cache.entries.items())
    blocks = np.array([entry.block for _, entry in entries], dtype=np.int64)
    snapshots = [(key, stored.state) for key, stored in cache.snapshots.items() if key in cache.entries]
    header = _layout(runner, runner.new_sequence().recurrent if runner.n_linear_layers else None)
    header.update(n_blocks=len(entries), n_snapshots=len(snapshots))
    with storage_errors("prefix cache save"):
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(path) as out:
            write_frame(out, MAGIC, VERSION, header)
            out.write(np.array([key for key, _ in entries], dtype=np.uint64).tobytes())
            out.write(np.array([entry.parent for _, entry in entries], dtype=np.uint64).tobytes())
            out.write(np.array([entry.tokens for _, entry in entries], dtype=np.int32).reshape(-1).tobytes())
            for layer in range(runner.n_attention_layers):
                out.write(np.ascontiguousarray(runner.kv.k[layer][blocks]).tobytes())
                out.write(np.ascontiguousarray(runner.kv.v[layer][blocks]).tobytes())
            out.write(np.array([key for key, _ in snapshots], dtype=np.uint64).tobytes())
            for _, state in snapshots:
                out.write(state.conv.tobytes())
            for _, state in snapshots:
                out.write(state.ssm.tobytes())
    return len(entries)


@dataclass(slots=True)
class _Reader:
    data: bytes
    offset: int

    def take(self, dtype: type, shape: tuple[int, ...]) -> np.ndarray:
        count = int(np.prod(shape))
        array = np.frombuffer(self.data, dtype=dtype, count=count, offset=self.offset).reshape(shape)
        self.offset += count * np.dtype(dtype).itemsize
        return array


def load_prefix_cache(runner: ModelRunner, cache: PrefixCache, path: Path) -> int:
    """Fill an empty cache from `path` (as many blocks as the pool has free); the number of blocks loaded.

    Temp files that killed saves left beside `path` are removed first, so call this before any save.
    Raises PrefixCacheFileError (or OSError, FileNotFoundError when there is no file yet) without changing
    the cache when the file is unusable.
    """
    remove_stale_temp_files(path.parent, path.name)
    data = path.read_bytes()
    header, offset = read_frame(data, MAGIC, VERSION, "prefix cache file", PrefixCacheFileError)
    try:
        n_blocks = int(header["n_blocks"])
        n_snapshots = int(header["n_snapshots"])
    except (ValueError, KeyError, TypeError) as exc:
        raise PrefixCacheFileError(f"header is invalid: {exc}") from exc
    if header.get("fingerprint") != runner.fingerprint:
        raise PrefixCacheFileError("file was saved from a different model")
    expected = _layout(runner, runner.new_sequence().recurrent if runner.n_linear_layers else None)
    for key, value in expected.items():
        if header.get(key) != value:
            raise PrefixCacheFileError(f"{key} {header.get(key)!r} does not match this server's {value!r}")
    if n_blocks < 0 or n_snapshots < 0 or (n_snapshots and expected["conv_shape"] is None):
        raise PrefixCacheFileError("block or snapshot count is invalid")
    kv_shape = (n_blocks, expected["n_kv_heads"], BLOCK_SIZE, expected["head_dim"])
    kv_dtype = np.dtype(expected["kv_dtype"])
    state_values = 0
    if expected["conv_shape"] is not None:
        state_values = int(np.prod(expected["conv_shape"]) + np.prod(expected["ssm_shape"]))
    kv_bytes = 2 * runner.n_attention_layers * int(np.prod(kv_shape)) * kv_dtype.itemsize
    size = n_blocks * (16 + 4 * BLOCK_SIZE) + kv_bytes + n_snapshots * (8 + 4 * state_values)
    if len(data) - offset != size:
        raise PrefixCacheFileError(f"payload is {len(data) - offset} bytes; {size} expected")

    reader = _Reader(data, offset)
    keys = reader.take(np.uint64, (n_blocks,))
    parents = reader.take(np.uint64, (n_blocks,))
    tokens = reader.take(np.int32, (n_blocks, BLOCK_SIZE))
    kv = [(reader.take(kv_dtype, kv_shape), reader.take(kv_dtype, kv_shape)) for _ in range(runner.n_attention_layers)]
    snapshot_keys = reader.take(np.uint64, (n_snapshots,))
    convs = reader.take(np.float32, (n_snapshots, *expected["conv_shape"])) if n_snapshots else None
    ssms = reader.take(np.float32, (n_snapshots, *expected["ssm_shape"])) if n_snapshots else None
    if n_blocks and (tokens.min() < 0 or tokens.max() >= runner.vocab_size):
        raise PrefixCacheFileError("token ids are outside the vocabulary")
    for i in range(n_blocks):
        if cache.key(int(parents[i]), tokens[i]) != int(keys[i]):
            raise PrefixCacheFileError(f"block {i} does not match its key (corrupt file)")

    pool = runner.pool
    room = pool.n_free - n_snapshots * cache.snapshot_cost_blocks  # snapshots must not evict loaded blocks
    loaded = []
    for i in range(max(0, min(n_blocks, room))):
        block = pool.allocate()
        for layer, (k, v) in enumerate(kv):
            runner.kv.k[layer][block] = k[i]
            runner.kv.v[layer][block] = v[i]
        cache.register(int(parents[i]), tokens[i].tolist(), block)
        loaded.append(block)
    # Cached and unreferenced, the blocks wait in the LRU queue for a hit. Parents come before their
    # children in the file: releasing in reverse makes chains lose their tails before their heads.
    for block in reversed(loaded):
        pool.release(block)
    template = runner.new_sequence().recurrent
    for j in range(n_snapshots):
        np.copyto(template.conv, convs[j])
        np.copyto(template.ssm, ssms[j])
        cache.add_snapshot(int(snapshot_keys[j]), template)
    return len(loaded)
