"""gguf-py's reader over a plain array view of the file's memory map, reading arrays in one pass.

GGUFReader slices its mapping once per metadata value, twice per string of an array, and a slice of an
np.memmap costs several times a plain ndarray's (its finalizer runs for every one): a 262,144-token
vocabulary (Gemma 3's) took 30 s to read, 5 s over a plain view. It also reads an array element by element,
each through its whole field parser (type lookups, size sums, index lists): that was most of what remained
(SmolLM2's 49,152 tokens and 48,900 merges 2.8 s, Qwen's 151,936 of each 7 s). Arrays of numbers and of
strings are read here in one pass instead, into the same parts, indexes and types GGUFReader gives (the
tests compare the two field by field). The mapping stays open as the view's base, and tensor data are views
of it, as before.
"""

from __future__ import annotations

import os
import struct
from typing import Any

import gguf
import numpy as np
from gguf import GGUFValueType

# A string's length, in the file's byte order where that is the host's (the only order read in one pass).
STRING_LENGTH = struct.Struct("=Q")
# An array field's header: its item type (uint32) and item count (uint64).
ARRAY_HEADER_BYTES = 12


class MappedGGUFReader(gguf.GGUFReader):
    """A GGUFReader whose `data` is an ndarray view of the np.memmap it opens."""

    @property
    def data(self) -> np.ndarray:
        return self._mapped

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._mapped = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[np.ndarray], list[int], list[Any]]:
        """GGUFReader's (size, parts, data indexes, types) of the field value at orig_offs: an array of numbers or
        strings read in one pass, anything else (and a file in the other byte order) as GGUFReader reads it."""
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        if len(raw_itype) != 1 or len(alen) != 1:
            raise ValueError(f"GGUF array at offset {orig_offs} runs past the end of the file")
        item_type, count, start = GGUFValueType(int(raw_itype[0])), int(alen[0]), orig_offs + ARRAY_HEADER_BYTES
        nptype = self.gguf_scalar_to_np.get(item_type)
        if nptype is not None:
            values = self._get(start, nptype, count)
            if len(values) != count:
                raise ValueError(f"GGUF array at offset {orig_offs} runs past the end of the file")
            items, size = list(values.reshape(count, 1)), int(values.nbytes)
        elif item_type == GGUFValueType.STRING:
            items, size = self._string_parts(start, count)
        else:  # arrays of arrays
            return super()._get_field_parts(orig_offs, raw_type)
        # GGUFReader's indexes: each item's last part; its types: the item type once there is an item.
        step = 2 if item_type == GGUFValueType.STRING else 1
        indexes = list(range(1 + step, 2 + step * count, step))
        types = [GGUFValueType.ARRAY, item_type] if count else [GGUFValueType.ARRAY]
        return ARRAY_HEADER_BYTES + size, [raw_itype, alen, *items], indexes, types

    def _string_parts(self, start: int, count: int) -> tuple[list[np.ndarray], int]:
        """The `count` strings from offset `start` as GGUFReader's parts (each string's length as one uint64, then
        its bytes), and the bytes they take."""
        data, end = self.data, len(self.data)
        parts: list[np.ndarray] = []
        offs = start
        for _ in range(count):
            if offs + STRING_LENGTH.size > end:
                raise ValueError(f"GGUF string at offset {offs} runs past the end of the file")
            (length,) = STRING_LENGTH.unpack_from(data, offs)
            text = offs + STRING_LENGTH.size
            if text + length > end:
                raise ValueError(f"GGUF string at offset {offs} runs past the end of the file")
            parts.append(data[offs:text].view(np.uint64))
            parts.append(data[text:text + length])
            offs = text + length
        return parts, offs - start


def read_gguf(path: str | os.PathLike[str]) -> gguf.GGUFReader:
    """The metadata and tensors of a GGUF file (raises what GGUFReader raises for a file it cannot read, and
    ValueError for an array that runs past the file's end)."""
    return MappedGGUFReader(path)
