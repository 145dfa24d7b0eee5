"""llama.cpp's logits of token windows, for tools/check_agreement.py; runs in an environment of its own.

    LLAMA_PYTHON/bin/python tools/llama_logits.py MODEL.gguf WINDOWS.npz OUT_DIR [--threads 2]

WINDOWS.npz holds arrays w0, w1, ... of token ids (int32). Each window is evaluated from an empty context by
llama-cpp-python (llama.cpp's own code, at its defaults: f16 KV), and its logits at every position are written to
OUT_DIR/wI.npy as float32 [len(window), vocab]. The ids are fed as they are: no BOS is added, so both engines read
the same tokens.

llama-cpp-python is a measuring tool here, never a dependency of BaseRT: build it from its source distribution in a
separate virtual environment (it vendors llama.cpp; CMAKE_ARGS="-DGGML_NATIVE=ON" builds it for this CPU):

    python3 -m venv LLAMA_PYTHON
    CMAKE_ARGS="-DGGML_NATIVE=ON" LLAMA_PYTHON/bin/pip install --no-binary llama-cpp-python llama-cpp-python numpy

This file imports only llama_cpp and numpy, so that environment needs nothing of BaseRT's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from llama_cpp import Llama


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf", type=Path)
    parser.add_argument("windows", type=Path, help="an .npz of int32 token windows w0, w1, ...")
    parser.add_argument("out", type=Path, help="the folder that receives wI.npy per window")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    windows = np.load(args.windows)
    names = sorted(windows.files, key=lambda name: int(name[1:]))
    longest = max(len(windows[name]) for name in names)
    model = Llama(model_path=str(args.gguf), n_ctx=longest, n_batch=longest, n_ubatch=longest, logits_all=True,
                  n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in names:
        ids = [int(i) for i in windows[name]]
        model.reset()
        model.eval(ids)
        np.save(args.out / f"{name}.npy", np.asarray(model.scores[:len(ids)], dtype=np.float32))
        print(f"llama.cpp: {name}, {len(ids)} positions", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
