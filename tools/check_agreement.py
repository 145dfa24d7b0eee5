"""How closely the default path (8-bit activations in integer dot products, 16-bit into the LM head) and llama.cpp
follow the exact float32 path on the same weights; or, with --cache-type, how closely a quantized KV cache follows the
default f16 one.

    python tools/check_agreement.py MODEL.base [MODEL.base ...] [--text FILE ...] [--positions 2048] [--window 512]
    python tools/check_agreement.py MODEL.base --gguf MODEL.gguf --llama-python LLAMA_PYTHON/bin/python
    python tools/check_agreement.py MODEL.base --cache-type q8_0 --window 2048

The exact path keeps f32 KV; the default path is the one `basert serve` runs, f16 KV (as llama.cpp's default).
Every path reads the same committed text, teacher-forced: the text is tokenized and cut into windows of --window
tokens, each window is one forward from an empty context with the logits of every position, and at each position
the next-token distribution of a candidate (the default path; llama.cpp; the default path over --cache-type KV) is
compared with the reference's (the exact path; the default path over f16 KV): top-1 agreement (the same argmax)
and the KL divergence KL(reference || candidate), in float64. Each path's perplexity over the text is printed
beside them (the next token of each position but a window's last). At least --positions positions per model.

With --gguf (one per model, in the same order: the GGUF the .base was converted from) and --llama-python (a Python
with llama-cpp-python built from its source distribution, a measuring tool only: see tools/llama_logits.py; also
$LLAMA_PYTHON), llama.cpp's own logits of the same token windows are compared with the same reference.

Prints one Markdown row per model and path. Exits 1 when the default path is less accurate than llama.cpp (a
larger mean KL or a lower top-1 agreement) where llama.cpp was measured, or misses --min-top1 (percent) or
--max-kl (mean KL in nats) where they are given.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from basert.engine.build import model_id_for, tokenizer_of
from basert.engine.runner import ForwardRequest, ModelRunner
from basert.format.reader import BaseFile

ROOT = Path(__file__).resolve().parent.parent
# Committed text, prose and code, read in this order until there are enough positions.
DEFAULT_TEXTS = [ROOT / "README.md", ROOT / "tests" / "fixtures" / "refdata" / "hybrid-math.md",
                 ROOT / "basert" / "engine" / "scheduler.py"]


def tokens_of(model: Path, texts: list[Path], wanted: int) -> list[int]:
    with BaseFile(model, verify_checksums=False) as base:
        tokenizer = tokenizer_of(base.tokenizer)
    if tokenizer is None:
        raise SystemExit(f"{model}: no tokenizer in the file")
    ids: list[int] = []
    for text in texts:
        ids += tokenizer.encode(text.read_text(encoding="utf-8"), parse_special=False)
        if len(ids) > wanted:
            break
    return ids


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def window_logits(runner: ModelRunner, window: list[int]) -> np.ndarray:
    seq = runner.new_sequence()
    try:
        return runner.forward([ForwardRequest(seq, window, logits="all")])[0].copy()
    finally:
        runner.release(seq)


@dataclass
class PathStats:
    """A path's agreement with the reference and its perplexity over the text, summed window by window."""

    name: str
    agree: int = 0
    total: int = 0
    kl_sum: float = 0.0
    kl_max: float = 0.0
    nll_sum: float = 0.0
    nll_count: int = 0

    def add(self, reference: np.ndarray, logp: np.ndarray, window: list[int]) -> None:
        """One window: `reference` and `logp` the two paths' log-probabilities at every position."""
        kl = np.sum(np.exp(reference) * (reference - logp), axis=-1)
        self.agree += int(np.sum(np.argmax(reference, axis=-1) == np.argmax(logp, axis=-1)))
        self.total += len(window)
        self.kl_sum += float(kl.sum())
        self.kl_max = max(self.kl_max, float(kl.max()))
        following = np.asarray(window[1:])
        self.nll_sum -= float(logp[np.arange(len(following)), following].sum())
        self.nll_count += len(following)

    @property
    def top1(self) -> float:
        return 100.0 * self.agree / self.total

    @property
    def kl_mean(self) -> float:
        return self.kl_sum / self.total

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / self.nll_count)


def windows_of(ids: list[int], positions: int, window: int) -> list[list[int]]:
    """The first windows of `ids` that hold at least `positions` positions (all of them if there are fewer)."""
    windows, total = [], 0
    for start in range(0, len(ids) - 1, window):
        windows.append(ids[start:start + window])
        total += len(windows[-1])
        if total >= positions:
            break
    return windows


def llama_logits(llama_python: str, gguf: Path, windows: list[list[int]], threads: int, folder: Path) -> list[Path]:
    """llama.cpp's logits of each window, computed by tools/llama_logits.py in `llama_python`: one .npy per window."""
    request = folder / "windows.npz"
    np.savez(request, **{f"w{i}": np.asarray(w, dtype=np.int32) for i, w in enumerate(windows)})
    subprocess.run([llama_python, str(Path(__file__).with_name("llama_logits.py")), str(gguf), str(request),
                    str(folder), "--threads", str(threads)], check=True)
    return [folder / f"w{i}.npy" for i in range(len(windows))]


def compare(model: Path, texts: list[Path], positions: int, window: int, cache_type: str | None = None,
            llama: tuple[str, Path] | None = None, threads: int = 2) -> list[PathStats]:
    """The reference path's stats (its perplexity; agreement with itself), then each candidate's: the default path
    against the exact one, and llama.cpp's logits (`llama`: its Python and the GGUF) against them too; or the
    default path over `cache_type` KV against it over f16 KV."""
    ids = tokens_of(model, texts, positions + 1)
    if len(ids) < 2:
        raise SystemExit(f"{model}: the texts give fewer than 2 tokens")
    windows = windows_of(ids, positions, window)
    if cache_type is None:
        # The reference is as exact as BaseRT computes (f32 weights arithmetic and KV); the default path is what
        # `basert serve` runs (f16 KV), as llama.cpp's defaults are.
        reference = ModelRunner(model, max_context=window, exact=True, threads=threads)
        default = ModelRunner(model, max_context=window, exact=False, cache_type_k="f16", cache_type_v="f16",
                              threads=threads)
        stats = [PathStats("exact"), PathStats("default")]
    else:
        reference = ModelRunner(model, max_context=window, exact=False, cache_type_k="f16", cache_type_v="f16",
                                threads=threads)
        default = ModelRunner(model, max_context=window, exact=False, cache_type_k=cache_type,
                              cache_type_v=cache_type, threads=threads)
        stats = [PathStats("default, f16 KV"), PathStats(f"default, {cache_type} KV")]
    with tempfile.TemporaryDirectory(prefix="llama-logits-") as folder:
        llama_files = []
        if llama is not None:
            llama_files = llama_logits(llama[0], llama[1], windows, threads, Path(folder))
            stats.append(PathStats("llama.cpp"))
        try:
            for index, chunk in enumerate(windows):
                p = log_softmax(window_logits(reference, chunk))
                stats[0].add(p, p, chunk)
                stats[1].add(p, log_softmax(window_logits(default, chunk)), chunk)
                if llama_files:
                    stats[2].add(p, log_softmax(np.load(llama_files[index])), chunk)
        finally:
            reference.close()
            default.close()
    return stats


def verdict(stats: list[PathStats], min_top1: float | None, max_kl: float | None) -> str:
    """'' when the default path (stats[1]) holds the bounds and is no less accurate than llama.cpp, else why not."""
    default, problems = stats[1], []
    if min_top1 is not None and default.top1 < min_top1:
        problems.append(f"top-1 below {min_top1}%")
    if max_kl is not None and default.kl_mean > max_kl:
        problems.append(f"mean KL above {max_kl}")
    for other in stats[2:]:
        if default.kl_mean > other.kl_mean or default.top1 < other.top1:
            problems.append(f"less accurate than {other.name}")
    return "; ".join(problems)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", type=Path, nargs="+")
    parser.add_argument("--text", type=Path, action="append", help="text to read (repeatable; default: "
                        + ", ".join(str(p.relative_to(ROOT)) for p in DEFAULT_TEXTS) + ")")
    parser.add_argument("--positions", type=int, default=2048, help="positions per model at least (default 2048)")
    parser.add_argument("--window", type=int, default=512, help="tokens per forward (default 512)")
    parser.add_argument("--threads", type=int, default=2, help="threads of every path (default 2)")
    parser.add_argument("--min-top1", type=float, help="required top-1 agreement of the default path, percent")
    parser.add_argument("--max-kl", type=float, help="largest acceptable mean KL of the default path (nats)")
    parser.add_argument("--cache-type", help="compare the default path over this KV type (K and V) with it over f16")
    parser.add_argument("--gguf", type=Path, action="append", default=[],
                        help="the GGUF each model was converted from, in the models' order: llama.cpp's logits too")
    parser.add_argument("--llama-python", default=os.environ.get("LLAMA_PYTHON"),
                        help="a Python with llama-cpp-python (default $LLAMA_PYTHON); see tools/llama_logits.py")
    args = parser.parse_args()
    if args.gguf and (len(args.gguf) != len(args.models) or not args.llama_python or args.cache_type):
        parser.error("--gguf needs one GGUF per model, --llama-python (or $LLAMA_PYTHON), and no --cache-type")
    texts = args.text or DEFAULT_TEXTS
    failed = False
    print("| model | path | positions | top-1 agreement | mean KL | max KL | perplexity |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for index, model in enumerate(args.models):
        llama = (args.llama_python, args.gguf[index]) if args.gguf else None
        stats = compare(model, texts, args.positions, args.window, args.cache_type, llama, args.threads)
        problem = verdict(stats, args.min_top1, args.max_kl)
        failed |= bool(problem)
        for path in stats:
            flag = f" FAILS: {problem}" if problem and path is stats[1] else ""
            print(f"| {model_id_for(model)} | {path.name} | {path.total} | {path.top1:.2f}% | {path.kl_mean:.2e} | "
                  f"{path.kl_max:.2e} | {path.perplexity:.3f} |{flag}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
