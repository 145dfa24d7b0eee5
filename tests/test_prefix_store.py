"""Prefix cache files: a round trip restores the blocks and snapshots; damaged or foreign files are refused."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
from test_engine_slots import make_engine, request, run

from basert.cli.serve import add_arguments, engine_options
from basert.engine import EngineOptions, build_engine
from basert.engine.kv import BLOCK_SIZE
from basert.engine.prefix_cache import PrefixCache
from basert.engine.runner import ModelRunner
from basert.engine.saved_state import PrefixCacheFileError, load_prefix_cache, prefix_cache_file, save_prefix_cache
from basert.testing.disk import DISK_ERROR, storage_error_message


def filled_engine(path: Path):
    engine = make_engine(path, slots=1, cache=True)
    prompt = np.random.default_rng(3).integers(0, engine.runner.vocab_size, 70).tolist()
    run(engine, [[request("a", prompt, segment_ends=(40,))]])
    return engine, prompt


def empty_cache(path: Path) -> tuple[ModelRunner, PrefixCache]:
    """A fresh engine's runner and empty prefix cache, wired as the server wires them."""
    engine = make_engine(path, slots=1, cache=True)
    return engine.runner, engine.prefix_cache


@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen3_5-tiny"])
def test_round_trip_restores_blocks_kv_and_snapshots(name: str, tiny_f32_bases: dict[str, Path], tmp_path: Path):
    engine, prompt = filled_engine(tiny_f32_bases[name])
    path = tmp_path / "pc.bin"
    saved = save_prefix_cache(engine.runner, engine.prefix_cache, path)
    assert saved == engine.prefix_cache.n_cached_blocks == (70 + MAX_TOKENS_FED) // BLOCK_SIZE
    runner, cache = empty_cache(tiny_f32_bases[name])
    assert load_prefix_cache(runner, cache, path) == saved
    before = engine.prefix_cache.lookup(prompt, len(prompt) - 1)
    after = cache.lookup(prompt, len(prompt) - 1)
    assert after.n_tokens == before.n_tokens > 0
    # Evicted tail first, as blocks released by a sequence are: a chain never keeps a tail without its head.
    assert list(runner.pool.evictable) == after.blocks[::-1]
    for old, new in zip(before.blocks, after.blocks):
        for layer in range(runner.n_attention_layers):
            assert np.array_equal(engine.runner.kv.k[layer][old], runner.kv.k[layer][new])
            assert np.array_equal(engine.runner.kv.v[layer][old], runner.kv.v[layer][new])
    if runner.n_linear_layers:
        assert np.array_equal(after.snapshot.ssm, before.snapshot.ssm)
        assert len(cache.snapshots) == len(engine.prefix_cache.snapshots)


MAX_TOKENS_FED = 5  # request() asks for 6 tokens; the last one is sampled but never fed


def test_damaged_and_foreign_files_are_refused_without_side_effects(tiny_f32_bases: dict[str, Path],
                                                                    tmp_path: Path):
    engine, _ = filled_engine(tiny_f32_bases["qwen3-tiny"])
    path = tmp_path / "pc.bin"
    save_prefix_cache(engine.runner, engine.prefix_cache, path)
    data = path.read_bytes()
    runner, cache = empty_cache(tiny_f32_bases["qwen3-tiny"])
    cases = {"truncated": data[:-3], "empty": b"", "magic": b"XXXX" + data[4:]}
    header_len = int.from_bytes(data[8:12], "little")
    n_blocks = json.loads(data[12: 12 + header_len])["n_blocks"]
    flipped = bytearray(data)
    flipped[12 + header_len + 16 * n_blocks + 2] ^= 0xFF    # a token of the first block: its key no longer matches
    cases["token"] = bytes(flipped)
    for label, content in cases.items():
        path.write_bytes(content)
        with pytest.raises(PrefixCacheFileError):
            load_prefix_cache(runner, cache, path)
        assert cache.n_cached_blocks == 0 and runner.pool.n_free == runner.pool.n_blocks, label
    path.write_bytes(data)
    other, other_cache = empty_cache(tiny_f32_bases["qwen3_5-tiny"])
    with pytest.raises(PrefixCacheFileError, match="different model"):
        load_prefix_cache(other, other_cache, path)


def test_file_name_is_flat_beside_the_path(tmp_path: Path):
    assert prefix_cache_file(tmp_path / "pc", None) == tmp_path / "pc"
    assert prefix_cache_file(tmp_path / "pc", "org/name") == tmp_path / "pc.org--name"
    assert prefix_cache_file(tmp_path / "pc", None, 3) == tmp_path / "pc.3"
    assert prefix_cache_file(tmp_path / "pc", "org/name", 3) == tmp_path / "pc.org--name.3"


def serve_options(*flags: str) -> EngineOptions:
    """The engine options `basert serve` gives a model for these flags."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return engine_options(parser.parse_args(flags))


@pytest.mark.parametrize("replica", [(), ("--replica", "1")])
def test_a_server_of_one_model_keeps_its_cache_in_the_file_named_and_adopts_its_old_file(
        replica: tuple[str, ...], tiny_f32_bases: dict[str, Path], tmp_path: Path):
    model = tiny_f32_bases["qwen3-tiny"]
    engine, _ = filled_engine(model)
    suffix = "".join(f".{rank}" for rank in replica[1:])
    old = tmp_path / f"pc.{engine.info.id}{suffix}"      # where a server of one model kept it before
    saved = save_prefix_cache(engine.runner, engine.prefix_cache, old)
    served = build_engine(model, serve_options(str(model), "--prefix-cache-file", str(tmp_path / "pc"), *replica))
    assert served.prefix_cache_file == tmp_path / f"pc{suffix}"
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"pc{suffix}"]   # renamed, once
    assert served.load_prefix_cache() == saved
    assert served.save_prefix_cache() == saved
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"pc{suffix}"]
    # Once PATH exists, a file under the old name is left alone.
    old.write_bytes(b"another file")
    build_engine(model, serve_options(str(model), "--prefix-cache-file", str(tmp_path / "pc"), *replica))
    assert load_prefix_cache(*empty_cache(model), tmp_path / f"pc{suffix}") == saved
    assert old.read_bytes() == b"another file"


def test_each_of_several_models_keeps_its_cache_in_a_file_of_its_own(tiny_f32_bases: dict[str, Path],
                                                                      tmp_path: Path):
    models = [str(tiny_f32_bases[name]) for name in ("qwen3-tiny", "qwen3_5-tiny")]
    options = serve_options(models[0], "--model", models[1], "--prefix-cache-file", str(tmp_path / "pc"))
    files = [build_engine(model, options).prefix_cache_file for model in models]
    assert files == [tmp_path / "pc.qwen3-tiny", tmp_path / "pc.qwen3_5-tiny"]


def test_a_load_first_removes_the_temp_files_of_killed_saves_of_this_file_only(tiny_f32_bases: dict[str, Path],
                                                                             tmp_path: Path):
    engine, _ = filled_engine(tiny_f32_bases["qwen3-tiny"])
    path = prefix_cache_file(tmp_path / "pc", "org/model")
    saved = save_prefix_cache(engine.runner, engine.prefix_cache, path)
    ours = [f".{path.name}.a1b2c3d4.tmp", f".{path.name}.x_y_z_09.tmp"]
    look_alikes = [".pc.org--other.a1b2c3d4.tmp", f".{path.name}.tmp", f"{path.name}.a1b2c3d4.tmp",
                   ".snap.a1b2c3d4.tmp"]
    for name in ours + look_alikes:
        (tmp_path / name).write_bytes(b"half a file")
    (tmp_path / f".{path.name}.dirdirdi.tmp").mkdir()
    runner, cache = empty_cache(tiny_f32_bases["qwen3-tiny"])
    assert load_prefix_cache(runner, cache, path) == saved
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(look_alikes + [path.name, f".{path.name}.dirdirdi.tmp"])
    # With no cache file yet (the first save was killed), the temp file still goes.
    (tmp_path / ours[0]).write_bytes(b"half a file")
    path.unlink()
    with pytest.raises(FileNotFoundError):
        load_prefix_cache(runner, cache, path)
    assert not (tmp_path / ours[0]).exists()


def test_a_save_that_hits_a_disk_error_raises_storage_error_and_keeps_the_previous_file(
        tiny_f32_bases: dict[str, Path], tmp_path: Path):
    engine, _ = filled_engine(tiny_f32_bases["qwen3_5-tiny"])
    path = tmp_path / "pc.model"
    save_prefix_cache(engine.runner, engine.prefix_cache, path)
    before = path.read_bytes()
    message = storage_error_message(len(before) // 2, """
        from pathlib import Path
        from basert.engine.saved_state import save_prefix_cache
        from test_prefix_store import filled_engine
        engine, _ = filled_engine(Path(sys.argv[1]))
        save_prefix_cache(engine.runner, engine.prefix_cache, Path(sys.argv[2]))
    """, str(tiny_f32_bases["qwen3_5-tiny"]), str(path), cwd=Path(__file__).parent)
    assert message == f"prefix cache save {DISK_ERROR}"
    assert [p.name for p in tmp_path.iterdir()] == ["pc.model"]
    assert path.read_bytes() == before
