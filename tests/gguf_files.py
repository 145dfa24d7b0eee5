"""GGUF files for tests, written with gguf-py: a one-layer model's metadata and tensors of any storage type."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType


def write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, Q]], *,
               hidden: int = 64, ff: int = 128, head_dim: int = 32) -> None:
    """A one-layer GGUF (4 heads, 2 kv heads, vocab 512) with the given tensors stored as the given types: float
    arrays quantized with gguf-py, or uint8 arrays [rows, row bytes] taken as blocks of that type."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    writer.add_context_length(2048)
    writer.add_vocab_size(512)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list([f"t{i}" for i in range(512)])
    writer.add_token_merges([])
    writer.add_token_types([1] * 512)
    for name, (values, qtype) in tensors.items():
        if qtype in (Q.F32, Q.F16):
            data = values.astype(np.float32 if qtype == Q.F32 else np.float16)
            writer.add_tensor(name, data)
        elif values.dtype == np.uint8:  # blocks given as their bytes, [rows, row bytes]
            writer.add_tensor(name, values, raw_shape=values.shape, raw_dtype=qtype)
        else:
            data = gguf.quants.quantize(values, qtype)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# Byte offsets of the f16 fields in each block type (d, and dmin or m where there is one); every other byte of
# a block is a code or a sub-block scale, for which any value is valid.
BLOCK_F16_FIELDS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
                    Q.Q5_0: (0,), Q.Q5_1: (0, 2)}


def random_blocks(rng: np.random.Generator, qtype: Q, rows: int, k: int, below: int = 0x3C00) -> np.ndarray:
    """[rows, row bytes] of random blocks of `qtype` whose f16 fields have magnitude bits below `below` (default:
    in (-1, 1), normal, subnormal or zero), so that the values also fit the f16 scales of a re-quantized copy."""
    size, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * k // size, nbytes), dtype=np.uint8)
    for at in BLOCK_F16_FIELDS[qtype]:
        signs = rng.integers(0, 2, blocks.shape[0], dtype=np.uint16) << np.uint16(15)
        halves = rng.integers(0, below, blocks.shape[0], dtype=np.uint16) | signs
        blocks[:, at:at + 2] = halves.astype("<u2").view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, k // size * nbytes)
