"""tools/llama_server_shim.py: llama-server command lines as `basert serve` arguments."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import llama_server_shim


def test_kv_types_context_shift_and_context_pass_through() -> None:
    t = llama_server_shim.translate(["-m", "model.gguf", "-c", "8192", "-np", "2", "-ctk", "q8_0",
                                     "--cache-type-v=bf16", "--context-shift", "-fa", "--no-warmup", "--no-webui"])
    arguments = t.serve_arguments()
    assert arguments[0] == "model.gguf" and t.notes == []
    for flag, value in (("-c", "8192"), ("--cache-type-k", "q8_0"), ("--cache-type-v", "bf16")):
        assert arguments[arguments.index(flag) + 1] == value
    assert "--context-shift" in arguments and "--no-webui" in arguments


def test_flags_without_a_counterpart_are_noted_not_passed() -> None:
    t = llama_server_shim.translate(["-m", "model.gguf", "--n-gpu-layers", "99", "--no-context-shift"])
    assert "--n-gpu-layers" not in t.serve_arguments() and "--context-shift" not in t.serve_arguments()
    assert any("--n-gpu-layers" in note for note in t.notes)
