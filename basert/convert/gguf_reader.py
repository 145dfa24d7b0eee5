"""gguf-py's reader over a plain array view of the file's memory map.

GGUFReader slices its mapping once per metadata value, twice per string of an array, and a slice of an
np.memmap costs several times a plain ndarray's (its finalizer runs for every one): a 262,144-token
vocabulary (Gemma 3's) took 30 s to read, 5 s this way. The mapping stays open as the view's base, and
tensor data are views of it, as before.
"""

from __future__ import annotations

import os

import gguf
import numpy as np


class MappedGGUFReader(gguf.GGUFReader):
    """A GGUFReader whose `data` is an ndarray view of the np.memmap it opens."""

    @property
    def data(self) -> np.ndarray:
        return self._mapped

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._mapped = value.view(np.ndarray) if isinstance(value, np.memmap) else value


def read_gguf(path: str | os.PathLike[str]) -> gguf.GGUFReader:
    """The metadata and tensors of a GGUF file (raises what GGUFReader raises for a file it cannot read)."""
    return MappedGGUFReader(path)
