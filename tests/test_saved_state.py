"""Saved state: files that the previous writers produced (slot snapshots BSLT v2, prefix cache files BPXC v1)
restore exactly; the runner's recurrent-state shapes; layouts that differ are refused.

The previous writers are kept below, unchanged but for their names, as the reference of both formats.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import FIXTURES
from test_engine_slots import make_engine, request, run
from test_prefix_store import empty_cache, filled_engine

from basert.engine import EngineOptions, build_engine
from basert.engine.kv import BLOCK_SIZE
from basert.engine.prefix_cache import PrefixCache
from basert.engine.runner import ModelRunner
from basert.engine.saved_state import (
    SnapshotError,
    SnapshotInfo,
    load_prefix_cache,
    restore_slot,
    save_prefix_cache,
    save_slot,
)
from basert.engine.sequence import RecurrentState
from basert.engine.slots import Slot
from basert.format.atomic import atomic_file, storage_errors
from basert.format.framed import FRAME, write_frame

# --- the previous writers: the reference of BSLT version 2 and BPXC version 1 --------------------------

SLOT_MAGIC = b"BSLT"
SLOT_VERSION = 2
PREFIX_MAGIC = b"BPXC"
PREFIX_VERSION = 1


def _kv_positions(cache: np.ndarray, blocks: np.ndarray, n: int) -> np.ndarray:
    """[n, n_kv_heads, head_dim] values of positions 0..n-1 gathered through a block table."""
    gathered = cache[blocks]                          # [nb, H, 16, d]
    return gathered.transpose(0, 2, 1, 3).reshape(-1, cache.shape[1], cache.shape[3])[:n]


def _slot_header_v2(runner: ModelRunner, slot: Slot) -> dict:
    seq = slot.sequence
    recurrent = seq.recurrent
    return {
        "fingerprint": runner.fingerprint,
        "arch": runner.arch,
        "n_tokens": seq.n_past,
        "kv_dtype": str(runner.kv.k[0].dtype) if runner.kv.k else "float32",
        "n_attention_layers": runner.n_attention_layers,
        "n_kv_heads": runner.config.num_key_value_heads,
        "head_dim": runner.config.head_dim,
        "conv_shape": list(recurrent.conv.shape) if recurrent is not None else None,
        "ssm_shape": list(recurrent.ssm.shape) if recurrent is not None else None,
        "checkpoints": [c.n_tokens for c in slot.checkpoints] if recurrent is not None else [],
    }


def save_slot_v2(runner: ModelRunner, slot: Slot, path: Path) -> SnapshotInfo:
    """Write the slot's state to `path` atomically; returns what was written. A disk error raises StorageError."""
    seq = slot.sequence
    header = _slot_header_v2(runner, slot)
    n = seq.n_past
    blocks = seq.block_table.view()
    with storage_errors("slot save"), atomic_file(path) as out:
        write_frame(out, SLOT_MAGIC, SLOT_VERSION, header)
        out.write(np.asarray(seq.tokens, dtype=np.int32).tobytes())
        for layer in range(runner.n_attention_layers):
            out.write(np.ascontiguousarray(_kv_positions(runner.kv.k[layer], blocks, n)).tobytes())
            out.write(np.ascontiguousarray(_kv_positions(runner.kv.v[layer], blocks, n)).tobytes())
        if seq.recurrent is not None:
            out.write(seq.recurrent.conv.tobytes())
            out.write(seq.recurrent.ssm.tobytes())
            for checkpoint in slot.checkpoints:
                out.write(checkpoint.state.conv.tobytes())
                out.write(checkpoint.state.ssm.tobytes())
        n_bytes = out.tell()
    return SnapshotInfo(n, n_bytes)


def _prefix_layout_v1(runner: ModelRunner, recurrent: RecurrentState | None) -> dict:
    return {
        "block_size": BLOCK_SIZE,
        "fingerprint": runner.fingerprint,
        "kv_dtype": {"f16": "float16", "f32": "float32"}[runner.kv.k_type.name],
        "n_attention_layers": runner.n_attention_layers,
        "n_kv_heads": runner.config.num_key_value_heads,
        "head_dim": runner.config.head_dim,
        "conv_shape": list(recurrent.conv.shape) if recurrent is not None else None,
        "ssm_shape": list(recurrent.ssm.shape) if recurrent is not None else None,
    }


def save_prefix_cache_v1(runner: ModelRunner, cache: PrefixCache, path: Path) -> int:
    """Write every cached block and snapshot to `path` atomically; the number of blocks written.

    A disk error raises StorageError and leaves the previous file as it was.
    """
    entries = list(cache.entries.items())
    blocks = np.array([entry.block for _, entry in entries], dtype=np.int64)
    snapshots = [(key, stored.state) for key, stored in cache.snapshots.items() if key in cache.entries]
    header = _prefix_layout_v1(runner, runner.new_sequence().recurrent if runner.n_linear_layers else None)
    header.update(n_blocks=len(entries), n_snapshots=len(snapshots))
    with storage_errors("prefix cache save"):
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(path) as out:
            write_frame(out, PREFIX_MAGIC, PREFIX_VERSION, header)
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


# --- models ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def linear_only_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3.5-style hybrid cut to its first three layers, all Gated DeltaNet: no attention layer."""
    from safetensors.numpy import load_file, save_file

    from basert.convert import convert

    source = FIXTURES / "refdata" / "models" / "qwen3_5-tiny"
    root = tmp_path_factory.mktemp("linear-only")
    model_dir = root / "hf"
    model_dir.mkdir()
    config = json.loads((source / "config.json").read_text())
    config.update(num_hidden_layers=3, layer_types=["linear_attention"] * 3)
    (model_dir / "config.json").write_text(json.dumps(config))
    tensors = {name: tensor for name, tensor in load_file(source / "model.safetensors").items()
               if not (m := re.match(r"model\.layers\.(\d+)\.", name)) or int(m[1]) < 3}
    save_file(tensors, str(model_dir / "model.safetensors"))
    out = root / "linear-only.base"
    convert(model_dir, out, target="f32")
    return out


MODELS = ["qwen3-tiny", "qwen3_5-tiny", "linear-only"]


@pytest.fixture(params=MODELS)
def model(request, tiny_f32_bases: dict[str, Path], linear_only_base: Path) -> Path:
    return linear_only_base if request.param == "linear-only" else tiny_f32_bases[request.param]


def split(data: bytes) -> tuple[dict, bytes]:
    """A framed file's JSON header and payload."""
    header_len = int.from_bytes(data[8:12], "little")
    return json.loads(data[FRAME.size: FRAME.size + header_len]), data[FRAME.size + header_len:]


def same_layout_headers(old: dict, new: dict, runner: ModelRunner) -> bool:
    """Whether a header of the earlier version (one `kv_dtype`) and one of this version (`k_type`, `v_type`) say the
    same: the earlier writer named float32 for a model without attention layers whatever the KV type."""
    old, new = dict(old), dict(new)
    old_type = {"float16": "f16", "float32": "f32"}[old.pop("kv_dtype")]
    new_types = (new.pop("k_type"), new.pop("v_type"))
    return old == new and (not runner.n_attention_layers or new_types == (old_type, old_type))


# --- tests ----------------------------------------------------------------------------------------------

def test_runner_reports_the_recurrent_shapes_and_kv_type(tiny_f32_bases: dict[str, Path], linear_only_base: Path):
    # qwen3_5-tiny: conv_dim = 2 * 2 key heads * 16 + 4 value heads * 24 = 160, kernel 4; 6 of 8 layers linear.
    expected = {"qwen3-tiny": (None, 0),
                "qwen3_5-tiny": (((6, 160, 3), (6, 4, 16, 24)), 4 * (6 * 160 * 3 + 6 * 4 * 16 * 24)),
                "linear-only": (((3, 160, 3), (3, 4, 16, 24)), 4 * (3 * 160 * 3 + 3 * 4 * 16 * 24))}
    for name, (shapes, nbytes) in expected.items():
        path = linear_only_base if name == "linear-only" else tiny_f32_bases[name]
        runner = ModelRunner(path, max_context=64, cache_type_k="f16", cache_type_v="q8_0")
        kv_types = (runner.kv.k_type.name, runner.kv.v_type.name)
        assert (runner.recurrent_shapes, runner.recurrent_state_nbytes, kv_types) == \
            (shapes, nbytes, ("f16", "q8_0")), name
        recurrent = runner.new_sequence().recurrent
        if shapes is None:
            assert recurrent is None
        else:
            assert (recurrent.conv.shape, recurrent.ssm.shape) == shapes
            assert recurrent.conv.nbytes + recurrent.ssm.nbytes == nbytes
        runner.close()


def test_a_v2_slot_snapshot_restores_exactly(model: Path, tmp_path: Path):
    engine, prompt = filled_engine(model)
    slot = engine.slots[0]
    assert len(slot.checkpoints) == (2 if engine.runner.n_linear_layers else 0)   # at 40 and 69
    old_file = tmp_path / "old.bin"
    written = save_slot_v2(engine.runner, slot, old_file)

    restored = make_engine(model)
    info = restored.restore_slot(0, old_file)
    assert info == written == SnapshotInfo(slot.sequence.n_past, old_file.stat().st_size)
    # Saved again, the restored slot gives the same payload: tokens, KV, states and checkpoints are exact.
    new_file = tmp_path / "new.bin"
    save_slot(restored.runner, restored.slots[0], new_file)
    old_header, old_payload = split(old_file.read_bytes())
    new_header, new_payload = split(new_file.read_bytes())
    assert new_payload == old_payload
    assert same_layout_headers(old_header, new_header, engine.runner)

    # The next turn continues from the restored history exactly as a fresh engine computes it.
    follow_up = slot.sequence.tokens + prompt[:7]
    tokens, cached = run(restored, [[request("next", follow_up)]])["next"]
    assert cached == slot.sequence.n_past
    assert tokens == run(make_engine(model), [[request("fresh", follow_up)]])["fresh"][0]


def test_a_v1_prefix_cache_file_loads_exactly(model: Path, tmp_path: Path):
    engine, prompt = filled_engine(model)
    old_file, new_file = tmp_path / "old.pc", tmp_path / "new.pc"
    saved = save_prefix_cache_v1(engine.runner, engine.prefix_cache, old_file)
    assert save_prefix_cache(engine.runner, engine.prefix_cache, new_file) == saved > 0
    (old_header, old_payload), (new_header, new_payload) = split(old_file.read_bytes()), split(new_file.read_bytes())
    assert new_payload == old_payload and same_layout_headers(old_header, new_header, engine.runner)

    runner, cache = empty_cache(model)
    assert load_prefix_cache(runner, cache, old_file) == saved
    assert set(cache.entries) == set(engine.prefix_cache.entries)
    assert set(cache.snapshots) == set(engine.prefix_cache.snapshots)
    for key, stored in cache.snapshots.items():
        before = engine.prefix_cache.snapshots[key].state
        assert np.array_equal(stored.state.conv, before.conv) and np.array_equal(stored.state.ssm, before.ssm)
    for key, entry in cache.entries.items():
        old_block = engine.prefix_cache.entries[key].block
        for layer in range(runner.n_attention_layers):
            assert np.array_equal(runner.kv.k[layer][entry.block], engine.runner.kv.k[layer][old_block])
            assert np.array_equal(runner.kv.v[layer][entry.block], engine.runner.kv.v[layer][old_block])
    limit = len(prompt) - 1
    assert cache.lookup(prompt, limit).n_tokens == engine.prefix_cache.lookup(prompt, limit).n_tokens


def test_a_snapshot_of_another_layout_is_refused_and_changes_nothing(tiny_f32_bases: dict[str, Path],
                                                                      linear_only_base: Path, tmp_path: Path):
    path = tmp_path / "slot.bin"
    engine, _ = filled_engine(tiny_f32_bases["qwen3_5-tiny"])
    save_slot(engine.runner, engine.slots[0], path)
    wider = EngineOptions(max_context=512, cache_type_k="f32", cache_type_v="f32")
    cases = {"k_type": build_engine(tiny_f32_bases["qwen3_5-tiny"], wider),
             "different model": make_engine(tiny_f32_bases["qwen3-tiny"])}
    for message, target in cases.items():
        pool = target.runner.pool
        with pytest.raises(SnapshotError, match=message):
            restore_slot(target.runner, target.slots, target.slots[0], path)
        assert target.slots[0].sequence.n_past == 0 and pool.n_free == pool.n_blocks, message
    data = path.read_bytes()
    path.write_bytes(data[:-1])
    with pytest.raises(SnapshotError, match="payload"):
        make_engine(tiny_f32_bases["qwen3_5-tiny"]).restore_slot(0, path)

    # Without attention layers there are no KV values: a snapshot reads the same whatever the KV type.
    engine, _ = filled_engine(linear_only_base)
    save_slot(engine.runner, engine.slots[0], path)
    wide = build_engine(linear_only_base, wider)
    assert wide.restore_slot(0, path).n_tokens == engine.slots[0].sequence.n_past
