"""Flags that several commands share, described once."""

from __future__ import annotations

import argparse


def add_exact_flag(p: argparse.ArgumentParser) -> None:
    """--exact: quantized weights on the float32 reference path."""
    p.add_argument("--exact", action="store_true",
                   help="quantized weights take the exact float32 path (slower): the reference that the default, "
                   "8-bit activations (16-bit into the LM head) in integer dot products as llama.cpp computes them, "
                   "is measured against; also BASERT_EXACT=1")
