"""How closely the default path (16-bit activations in integer dot products) follows the exact float32 path; or,
with --cache-type, how closely a quantized KV cache follows the default f16 one.

    python tools/check_agreement.py MODEL.base [MODEL.base ...] [--text FILE ...] [--positions 2048] [--window 512]
    python tools/check_agreement.py MODEL.base --cache-type q8_0 --window 2048 --min-top1 99

Both paths of the same weights read the same committed text, teacher-forced: the text is tokenized and cut into
windows of --window tokens, each window is one forward with the logits of every position, and at each position the
next-token distribution of the candidate (the default path; the default path over --cache-type KV) is compared with
the reference's (the exact path; the default path over f16 KV): top-1 agreement (the same argmax) and the KL
divergence KL(reference || candidate), in float64. At least --positions positions per model.

Prints one Markdown row per model and exits 1 when a model misses --min-top1 (percent, default 98.5) or --max-kl
(mean KL in nats, default 0.005): the tolerances the default path is held to.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from basert.engine.build import tokenizer_of
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


def compare(model: Path, texts: list[Path], positions: int, window: int,
            cache_type: str | None = None) -> tuple[int, float, float, float]:
    """(positions, top-1 agreement in percent, mean KL, largest KL) of the default path against the exact one, or
    of the default path over `cache_type` KV against it over f16 KV."""
    ids = tokens_of(model, texts, positions + 1)
    if len(ids) < 2:
        raise SystemExit(f"{model}: the texts give fewer than 2 tokens")
    if cache_type is None:
        exact = ModelRunner(model, max_context=window, exact=True)
        default = ModelRunner(model, max_context=window, exact=False)
    else:
        exact = ModelRunner(model, max_context=window, exact=False, cache_type_k="f16", cache_type_v="f16")
        default = ModelRunner(model, max_context=window, exact=False, cache_type_k=cache_type, cache_type_v=cache_type)
    agree = total = 0
    kl_sum, kl_max = 0.0, 0.0
    try:
        for start in range(0, len(ids) - 1, window):
            chunk = ids[start:start + window]
            p, q = log_softmax(window_logits(exact, chunk)), log_softmax(window_logits(default, chunk))
            kl = np.sum(np.exp(p) * (p - q), axis=-1)
            agree += int(np.sum(np.argmax(p, axis=-1) == np.argmax(q, axis=-1)))
            total += len(chunk)
            kl_sum += float(kl.sum())
            kl_max = max(kl_max, float(kl.max()))
            if total >= positions:
                break
    finally:
        exact.close()
        default.close()
    return total, 100.0 * agree / total, kl_sum / total, kl_max


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", type=Path, nargs="+")
    parser.add_argument("--text", type=Path, action="append", help="text to read (repeatable; default: "
                        + ", ".join(str(p.relative_to(ROOT)) for p in DEFAULT_TEXTS) + ")")
    parser.add_argument("--positions", type=int, default=2048, help="positions per model at least (default 2048)")
    parser.add_argument("--window", type=int, default=512, help="tokens per forward (default 512)")
    parser.add_argument("--min-top1", type=float, default=98.5, help="required top-1 agreement, percent")
    parser.add_argument("--max-kl", type=float, default=0.005, help="largest acceptable mean KL divergence (nats)")
    parser.add_argument("--cache-type", help="compare the default path over this KV type (K and V) with it over f16")
    args = parser.parse_args()
    texts = args.text or DEFAULT_TEXTS
    failed = False
    print("| model | positions | top-1 agreement | mean KL | max KL |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for model in args.models:
        total, top1, kl_mean, kl_max = compare(model, texts, args.positions, args.window, args.cache_type)
        ok = top1 >= args.min_top1 and kl_mean <= args.max_kl
        failed |= not ok
        print(f"| {model.name} | {total} | {top1:.2f}% | {kl_mean:.2e} | {kl_max:.2e} |{'' if ok else ' FAILS'}",
              flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
