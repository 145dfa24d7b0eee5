"""A model whose GGUF weights are K-quant and Q5_0/Q5_1 blocks, kept as they are in the .base: the engine computes
with exactly their de-quantized values, so its logits are the bits of the same model stored as float32."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf_files import Q, random_blocks, write_gguf

from basert._ext import VARIANT
from basert._ext import matmul as mm
from basert.convert import convert
from basert.engine.runner import ForwardRequest, ModelRunner
from basert.format import BaseFile

HIDDEN, FF, HEAD_DIM = 256, 512, 64
# Every block type on one of the layer's matrices ([rows, K], K a multiple of 256 for the K-quants).
MATRICES = {
    "blk.0.attn_q.weight": (Q.Q4_K, 4 * HEAD_DIM, HIDDEN),
    "blk.0.attn_k.weight": (Q.Q5_K, 2 * HEAD_DIM, HIDDEN),
    "blk.0.attn_v.weight": (Q.Q6_K, 2 * HEAD_DIM, HIDDEN),
    "blk.0.attn_output.weight": (Q.Q3_K, HIDDEN, 4 * HEAD_DIM),
    "blk.0.ffn_gate.weight": (Q.Q5_0, FF, HIDDEN),
    "blk.0.ffn_up.weight": (Q.Q5_1, FF, HIDDEN),
    "blk.0.ffn_down.weight": (Q.Q2_K, HIDDEN, FF),
}


def models(tmp_path: Path) -> tuple[Path, Path]:
    """The model with block weights, and the same model with those weights as float32 (gguf-py's values)."""
    rng = np.random.default_rng(5)
    shared = {
        "token_embd.weight": (rng.standard_normal((512, HIDDEN), dtype=np.float32), Q.Q8_0),
        "output_norm.weight": (1 + 0.1 * rng.standard_normal(HIDDEN, dtype=np.float32), Q.F32),
        "blk.0.attn_norm.weight": (1 + 0.1 * rng.standard_normal(HIDDEN, dtype=np.float32), Q.F32),
        "blk.0.ffn_norm.weight": (1 + 0.1 * rng.standard_normal(HIDDEN, dtype=np.float32), Q.F32),
    }
    # f16 fields below 2^-6: weights of a few units at most, so activations stay moderate.
    blocks = {name: (random_blocks(rng, qtype, rows, k, below=0x2400), qtype)
              for name, (qtype, rows, k) in MATRICES.items()}
    floats = {name: (gguf.quants.dequantize(raw, qtype).astype(np.float32), Q.F32)
              for name, (raw, qtype) in blocks.items()}
    paths = []
    for label, weights in (("blocks", blocks), ("f32", floats)):
        src = tmp_path / f"{label}.gguf"
        write_gguf(src, "llama", {**shared, **weights}, hidden=HIDDEN, ff=FF, head_dim=HEAD_DIM)
        out = tmp_path / f"{label}.base"
        convert(src, out)
        paths.append(out)
    return paths[0], paths[1]


def test_block_weights_give_the_float32_models_logits(tmp_path: Path):
    with_blocks, with_floats = models(tmp_path)
    with BaseFile(with_blocks) as base:
        assert {base.tensors[f"layers.0.{part}"].storage for part in (
            "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
        )} == {"Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q5_0", "Q5_1", "Q2_K"}
    ids = [int(i) for i in np.random.default_rng(6).integers(0, 512, 40)]
    results = []
    for path in (with_blocks, with_floats):
        # The exact path: blocks de-quantized to the float model's values (the integer path reads the two differently).
        runner = ModelRunner(path, max_context=128, exact=True)
        try:
            seq = runner.new_sequence()
            prompt = runner.forward([ForwardRequest(seq, ids, logits="all")])[0].copy()
            step = runner.forward([ForwardRequest(seq, [int(np.argmax(prompt[-1]))])])[0].copy()
            runner.release(seq)
        finally:
            runner.close()
        assert np.isfinite(prompt).all() and np.isfinite(step).all()
        results.append((prompt, step))
    (prompt_a, step_a), (prompt_b, step_b) = results
    assert np.array_equal(prompt_a.view(np.uint32), prompt_b.view(np.uint32))
    assert np.array_equal(step_a.view(np.uint32), step_b.view(np.uint32))


def test_a_tied_k_quant_embedding_is_packed_once_for_lookup_and_head(tmp_path: Path):
    """token_embd as Q4_K and no output tensor: the embedding lookups and the LM head read one packed copy (on the SIMD
    variants), and the lookups give the blocks' values."""
    rng = np.random.default_rng(7)
    embedding = random_blocks(rng, Q.Q4_K, 512, HIDDEN, below=0x2400)
    tensors = {
        "token_embd.weight": (embedding, Q.Q4_K),
        "output_norm.weight": (1 + 0.1 * rng.standard_normal(HIDDEN, dtype=np.float32), Q.F32),
        "blk.0.attn_norm.weight": (1 + 0.1 * rng.standard_normal(HIDDEN, dtype=np.float32), Q.F32),
        "blk.0.ffn_norm.weight": (1 + 0.1 * rng.standard_normal(HIDDEN, dtype=np.float32), Q.F32),
        **{name: (random_blocks(rng, Q.Q4_K, rows, k, below=0x2400), Q.Q4_K)
           for name, (rows, k) in {"blk.0.attn_q.weight": (4 * HEAD_DIM, HIDDEN),
                                   "blk.0.attn_k.weight": (2 * HEAD_DIM, HIDDEN),
                                   "blk.0.attn_v.weight": (2 * HEAD_DIM, HIDDEN),
                                   "blk.0.attn_output.weight": (HIDDEN, 4 * HEAD_DIM),
                                   "blk.0.ffn_gate.weight": (FF, HIDDEN), "blk.0.ffn_up.weight": (FF, HIDDEN),
                                   "blk.0.ffn_down.weight": (HIDDEN, FF)}.items()},
    }
    src, out = tmp_path / "tied.gguf", tmp_path / "tied.base"
    write_gguf(src, "llama", tensors, hidden=HIDDEN, ff=FF, head_dim=HEAD_DIM)
    convert(src, out)
    runner = ModelRunner(out, max_context=64, exact=False)
    try:
        embed, head = runner.model.embed, runner.model.head
        assert embed.packed == head.packed == (VARIANT != "portable")
        assert np.shares_memory(embed.data, head.data) and head.act_bits == 16
        ids = np.array([0, 9, 511, 8], dtype=np.int32)
        rows = np.zeros((ids.size, HIDDEN), dtype=np.float32)
        mm.embed_rows(embed, ids, rows)
        values = gguf.quants.dequantize(embedding, Q.Q4_K).reshape(512, HIDDEN)
        assert np.array_equal(rows, values[ids])
        seq = runner.new_sequence()
        logits = runner.forward([ForwardRequest(seq, [int(i) for i in ids])])[0]
        assert logits.shape == (1, 512) and np.isfinite(logits).all()
    finally:
        runner.close()
