"""Saves interrupted by kill -9 or by a disk error: no temp file survives and nothing is half-stored.

Disk errors are real: the write runs in a fresh interpreter whose file size limit (RLIMIT_FSIZE) makes
the kernel refuse it with EFBIG (Python ignores SIGXFSZ). Kills are real SIGKILLs of `basert serve`.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path

import pytest

from basert.format.atomic import atomic_file, remove_stale_temp_files, stale_temp_files
from basert.testing.disk import DISK_ERROR, storage_error_message

TESTS = Path(__file__).parent
def test_stale_temp_files_finds_the_temp_that_atomic_file_writes(tmp_path: Path):
    with atomic_file(tmp_path / "snap.bin") as out:
        out.write(b"half")
        out.flush()
        temps = stale_temp_files(tmp_path)
        assert [p.name for p in temps] == [p.name for p in stale_temp_files(tmp_path, "snap.bin")]
        assert len(temps) == 1 and temps[0].read_bytes() == b"half"
        assert stale_temp_files(tmp_path, "other.bin") == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snap.bin"]


def test_remove_stale_temp_files_removes_only_atomic_file_temps(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    ours = [".snap.bin.a1b2c3d4.tmp", ".slot 0.bin.zz_09xyz.tmp", "..hidden.abcdefgh.tmp"]
    look_alikes = ["snap.bin.a1b2c3d4.tmp", ".snap.bin.tmp", ".snap.bin.a1b2c3d.tmp", ".snap.bin.ABCDEFGH.tmp",
                   ".snap.bin.a1b2c3d4.temp", ".snap.bin.a1b2c3d4.tmp.bak", "snap.bin", ".a1b2c3d4.tmp"]
    for name in ours + look_alikes:
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / ".dir.a1b2c3d4.tmp").mkdir()
    outside = tmp_path.parent / f"{tmp_path.name}-target"
    outside.write_bytes(b"not ours")
    os.symlink(outside, tmp_path / ".link.a1b2c3d4.tmp")
    with caplog.at_level(logging.INFO, logger="basert.storage"):
        assert remove_stale_temp_files(tmp_path) == 3
    assert "Removed 3 files" in caplog.text
    kept = sorted(look_alikes + [".dir.a1b2c3d4.tmp", ".link.a1b2c3d4.tmp"])
    assert sorted(p.name for p in tmp_path.iterdir()) == kept
    assert outside.read_bytes() == b"not ours"


def test_a_slot_save_that_hits_a_disk_error_raises_storage_error_and_leaves_no_temp(
        tiny_f32_bases: dict[str, Path], tmp_path: Path):
    (tmp_path / "other.bin").write_bytes(b"kept")
    # The snapshot (75 tokens of KV and the recurrent states) is far larger than 16 KiB.
    message = storage_error_message(16384, """
        from pathlib import Path
        from basert.engine.saved_state import save_slot
        from test_prefix_store import filled_engine
        engine, _ = filled_engine(Path(sys.argv[1]))
        save_slot(engine.runner, engine.slots[0], Path(sys.argv[2]))
    """, str(tiny_f32_bases["qwen3_5-tiny"]), str(tmp_path / "slot0.bin"), cwd=Path(__file__).parent)
    assert message == f"slot save {DISK_ERROR}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.bin"]


def load_tool():
    spec = importlib.util.spec_from_file_location("kill_during_saves", TESTS.parent / "tools" / "kill_during_saves.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # three kill -9 runs per save target, each a server start and a restart
def test_kill_9_during_saves_leaves_no_temp_file_and_a_loadable_cache(smollm2_base: Path, tmp_path: Path):
    tool = load_tool()
    results = tool.kill_during_saves(smollm2_base, tmp_path, runs=3, seed=1)
    tool.print_table(results)
    assert [r.target for r in results] == list(tool.TARGETS)
    for r in results:
        assert (r.left_after_restart, r.incomplete_files) == (0, 0), r
        assert r.warmed_blocks is not None, r
    assert results[-1].warmed_blocks > 0
    assert sum(r.left_at_kill for r in results) > 0     # the kills did interrupt saves
