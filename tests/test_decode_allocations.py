"""Decoding allocates no array data per token: every batch array and the logits live in the workspace."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

from basert.engine.runner import ForwardRequest, ModelRunner


def test_a_decode_step_allocates_no_array_data(smollm2_base: Path):
    runner = ModelRunner(smollm2_base, max_context=256, cache_type_k="f16", cache_type_v="f16")
    seq = runner.new_sequence()
    runner.forward([ForwardRequest(seq, list(range(1, 20)))])
    for token in (5, 6):            # the workspace reaches its decode size
        runner.forward([ForwardRequest(seq, [token])])
    logits_bytes = runner.vocab_size * 4
    tracemalloc.start()
    try:
        for token in range(7, 27):
            before, _ = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            runner.forward([ForwardRequest(seq, [token])])
            _, peak = tracemalloc.get_traced_memory()
            # Small Python objects (the request, a batch item, views) only: far below one logits row.
            assert peak - before < logits_bytes // 8, f"token {token}: {peak - before} bytes allocated"
    finally:
        tracemalloc.stop()
        runner.close()
