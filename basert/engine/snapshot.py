"""Slot snapshots: one lane's tokens, the KV of its used positions and its recurrent state, in one file.

Layout (little-endian): magic `BSLT`, u32 version (2), u32 header length, UTF-8 JSON header, then
int32 token ids, per attention layer K then V as [n_tokens, n_kv_heads, head_dim] in the cache's
element type, then (hybrids) the float32 conv and ssm states, then those of each lane checkpoint.
A restore validates every length, the version and the model fingerprint before touching the lane.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from basert.engine.engine import MAX_LANE_CHECKPOINTS, Checkpoint, Engine, Lane
from basert.engine.kv import BLOCK_SIZE, blocks_for
from basert.engine.runner import ModelRunner
from basert.format.atomic import atomic_file, storage_errors
from basert.format.framed import read_frame, write_frame

MAGIC = b"BSLT"
VERSION = 2


class SnapshotError(ValueError):
    """A snapshot file cannot be restored into this model: the message says why."""


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    n_tokens: int
    n_bytes: int


def _kv_positions(cache: np.ndarray, blocks: np.ndarray, n: int) -> np.ndarray:
    """[n, n_kv_heads, head_dim] values of positions 0..n-1 gathered through a block table."""
    gathered = cache[blocks]                          # [nb, H, 16, d]
    return gathered.transpose(0, 2, 1, 3).reshape(-1, cache.shape[1], cache.shape[3])[:n]


def _header(runner: ModelRunner, lane: Lane) -> dict:
    seq = lane.sequence
    recurrent = seq.recurrent
    return {
        "fingerprint": runner.fingerprint,
        "arch": runner.arch,
        "n_tokens": seq.n_past,
        "kv_dtype": str(runner.kv.k[0].dtype) if runner.kv.k else "float32",
        "n_attention_layers": runner.n_attention_layers,
        "n_kv_heads": runner.config["num_key_value_heads"],
        "head_dim": runner.config["head_dim"],
        "conv_shape": list(recurrent.conv.shape) if recurrent is not None else None,
        "ssm_shape": list(recurrent.ssm.shape) if recurrent is not None else None,
        "checkpoints": [c.n_tokens for c in lane.checkpoints] if recurrent is not None else [],
    }


def save_lane(runner: ModelRunner, lane: Lane, path: Path) -> SnapshotInfo:
    """Write the lane's state to `path` atomically; returns what was written. A disk error raises StorageError."""
    seq = lane.sequence
    header = _header(runner, lane)
    n = seq.n_past
    blocks = seq.block_table.view()
    with storage_errors("slot save"), atomic_file(path) as out:
        write_frame(out, MAGIC, VERSION, header)
        out.write(np.asarray(seq.tokens, dtype=np.int32).tobytes())
        for layer in range(runner.n_attention_layers):
            out.write(np.ascontiguousarray(_kv_positions(runner.kv.k[layer], blocks, n)).tobytes())
            out.write(np.ascontiguousarray(_kv_positions(runner.kv.v[layer], blocks, n)).tobytes())
        if seq.recurrent is not None:
            out.write(seq.recurrent.conv.tobytes())
            out.write(seq.recurrent.ssm.tobytes())
            for checkpoint in lane.checkpoints:
                out.write(checkpoint.state.conv.tobytes())
                out.write(checkpoint.state.ssm.tobytes())
        n_bytes = out.tell()
    return SnapshotInfo(n, n_bytes)


def restore_lane(engine: Engine, lane: Lane, path: Path) -> SnapshotInfo:
    """Replace the lane's state with a snapshot; the file is fully validated first.

    The restored full blocks join the prefix cache (when there is one), so other lanes can share them.
    """
    runner = engine.runner
    data = path.read_bytes()
    header, offset = read_frame(data, MAGIC, VERSION, "slot snapshot", SnapshotError)
    try:
        n = int(header["n_tokens"])
        fingerprint = header["fingerprint"]
    except (ValueError, KeyError, TypeError) as exc:
        raise SnapshotError(f"snapshot header is invalid: {exc}") from exc
    if fingerprint != runner.fingerprint:
        raise SnapshotError("snapshot was saved from a different model")
    expected = _header(runner, lane)
    for key in ("n_attention_layers", "n_kv_heads", "head_dim", "kv_dtype", "conv_shape", "ssm_shape"):
        if header.get(key) != expected[key]:
            raise SnapshotError(f"snapshot {key} {header.get(key)!r} does not match this server's {expected[key]!r}")
    if not 0 <= n <= runner.max_context:
        raise SnapshotError(f"snapshot holds {n} tokens; the context window is {runner.max_context}")
    checkpoints = header.get("checkpoints")
    if not isinstance(checkpoints, list) or not all(isinstance(c, int) and 0 <= c <= n for c in checkpoints) \
            or (checkpoints and expected["conv_shape"] is None) or len(checkpoints) > MAX_LANE_CHECKPOINTS:
        raise SnapshotError("snapshot checkpoint positions are invalid")
    kv_dtype = np.dtype(expected["kv_dtype"])
    kv_values = n * expected["n_kv_heads"] * expected["head_dim"]
    recurrent_values = 0
    if expected["conv_shape"] is not None:
        recurrent_values = int(np.prod(expected["conv_shape"]) + np.prod(expected["ssm_shape"]))
    n_states = (1 + len(checkpoints)) if recurrent_values else 0
    size = 4 * n + 2 * runner.n_attention_layers * kv_values * kv_dtype.itemsize + 4 * recurrent_values * n_states
    if len(data) - offset != size:
        raise SnapshotError(f"snapshot payload is {len(data) - offset} bytes; {size} expected")
    tokens = np.frombuffer(data, dtype=np.int32, count=n, offset=offset)
    if n and (tokens.min() < 0 or tokens.max() >= runner.vocab_size):
        raise SnapshotError("snapshot token ids are outside the vocabulary")
    offset += 4 * n

    seq = lane.sequence
    lane.forget(runner)
    engine.make_room(blocks_for(n))
    seq.block_table.ensure(n, runner.pool)
    blocks = seq.block_table.view()
    shape = (expected["n_kv_heads"], expected["head_dim"])
    padded = len(blocks) * BLOCK_SIZE
    for layer in range(runner.n_attention_layers):
        for cache in (runner.kv.k[layer], runner.kv.v[layer]):
            values = np.frombuffer(data, dtype=kv_dtype, count=kv_values, offset=offset).reshape(n, *shape)
            offset += kv_values * kv_dtype.itemsize
            full = np.zeros((padded, *shape), dtype=kv_dtype)
            full[:n] = values
            cache[blocks] = full.reshape(len(blocks), BLOCK_SIZE, *shape).transpose(0, 2, 1, 3)
    if seq.recurrent is not None:
        offset = _read_state(data, offset, seq.recurrent.conv, seq.recurrent.ssm)
        for n_tokens in checkpoints:
            state = seq.recurrent.clone()
            offset = _read_state(data, offset, state.conv, state.ssm)
            lane.checkpoints.append(Checkpoint(n_tokens, state))
    seq.tokens[:] = tokens.tolist()
    engine.register_blocks(seq)
    return SnapshotInfo(n, len(data))


def _read_state(data: bytes, offset: int, conv: np.ndarray, ssm: np.ndarray) -> int:
    for target in (conv, ssm):
        target[...] = np.frombuffer(data, dtype=np.float32, count=target.size, offset=offset).reshape(target.shape)
        offset += 4 * target.size
    return offset
