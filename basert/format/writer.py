"""Writes `.base` files: payloads stream to a spool file as tensors are added, and the finished file
replaces the destination atomically on close, so a failed conversion never leaves a partial model."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import xxhash

from basert import __version__
from basert.format.atomic import atomic_file
from basert.format.ggml_blocks import BLOCK_LAYOUT, BlockType
from basert.format.quant import ALLOWED_GROUP_SIZES, DENSE_DTYPES, SCALE_DTYPES, QuantizedTensor, f32_to_bf16_bits

MAGIC = b"BASE"
FORMAT_VERSION = 1
BLOB_ALIGN = 65536
ALIGNMENT = {"accel_align_log2": 6, "gpu_page_log2": 14, "cpu_align_log2": 6}
REGION_ALIGN = {
    "accelerator": 1 << ALIGNMENT["accel_align_log2"],
    "gpu": 1 << ALIGNMENT["gpu_page_log2"],
    "cpu": 1 << ALIGNMENT["cpu_align_log2"],
}
# Scale and bias regions start on cache-line boundaries inside a quantized payload.
REGION_PART_ALIGN = 64
_COPY_CHUNK = 16 << 20


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def align_up(value: int, alignment: int) -> int:
    """The smallest multiple of `alignment` that is >= `value`."""
    return -(-value // alignment) * alignment


class BaseWriter:
    """Context manager that writes one `.base` file; tensors are added in the order they will be stored."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        arch: str,
        config: dict[str, Any],
        tokenizer: dict[str, Any],
        source: dict[str, Any],
        quant_scheme: str,
        metadata: dict[str, Any] | None = None,
        flags: int = 0,
        quant_profile: dict[str, Any] | None = None,
    ) -> None:
        self.path = Path(path)
        self._header: dict[str, Any] = {
            "schema": 1,
            "arch": arch,
            "quant_scheme": quant_scheme,
            "min_hw": "avx2",
            "created": str(int(time.time())),
            "baserT_version": __version__,
            "source": source,
            "tokenizer": tokenizer,
            "config": config,
            "metadata": metadata if metadata is not None else {},
            "target_backend": "cpu_avx2",
        }
        if quant_profile is not None:
            self._header["quant_profile"] = quant_profile
        self._header["alignment"] = dict(ALIGNMENT)
        self._header["flags"] = hex(flags)
        # GGUF sources keep GGUF's innermost-first shape order in the header.
        self._gguf_order = source.get("format") == "gguf"
        self._tensors: list[dict[str, Any]] = []
        self._names: set[str] = set()
        self._finished = False
        fd, spool_path = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".spool")
        self._spool_path = Path(spool_path)
        self._spool = os.fdopen(fd, "w+b")

    def __enter__(self) -> BaseWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def add_dense(
        self,
        name: str,
        array: np.ndarray,
        dtype: str,
        *,
        shape: list[int] | None = None,
        flags: int = 0,
        compute_region: str = "cpu",
    ) -> None:
        """Store `array` as f32, f16 or bf16 (a uint16 array with dtype "bf16" is taken as raw bf16 bits)."""
        if dtype not in DENSE_DTYPES:
            raise ValueError(f"tensor {name!r}: dense dtype must be one of {DENSE_DTYPES}, got {dtype!r}")
        array = np.asarray(array)
        if dtype == "f32":
            stored = np.ascontiguousarray(array, dtype="<f4")
        elif dtype == "f16":
            stored = np.ascontiguousarray(array, dtype="<f2")
        elif array.dtype == np.uint16:
            stored = np.ascontiguousarray(array, dtype="<u2")
        else:
            stored = f32_to_bf16_bits(array)
        header_shape, offset = self._begin(name, array.shape, shape, compute_region)
        hasher = xxhash.xxh64()
        self._write(stored, hasher)
        entry = {"name": name, "dtype": dtype, "shape": header_shape, "offset": offset, "length": stored.nbytes}
        self._finish(entry, hasher, flags, compute_region)

    def add_quantized(
        self,
        name: str,
        q: QuantizedTensor,
        *,
        shape: list[int] | None = None,
        flags: int = 0,
        compute_region: str = "cpu",
    ) -> None:
        """Store a group-quantized tensor as `[packed values][scales][biases]`."""
        if q.group_size not in ALLOWED_GROUP_SIZES:
            raise ValueError(f"tensor {name!r}: group_size must be one of {ALLOWED_GROUP_SIZES}, got {q.group_size}")
        if q.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"tensor {name!r}: scale_dtype must be one of {SCALE_DTYPES}, got {q.scale_dtype!r}")
        header_shape, offset = self._begin(name, q.shape, shape, compute_region)
        hasher = xxhash.xxh64()
        packed = np.ascontiguousarray(q.packed, dtype=np.uint8)
        scales = np.ascontiguousarray(q.scales, dtype="<u2")
        self._write(packed, hasher)
        scale_offset = self._pad_within(packed.nbytes, hasher)
        self._write(scales, hasher)
        length = scale_offset + scales.nbytes
        regions = {"scale_offset": scale_offset, "scale_length": scales.nbytes}
        if q.biases is not None:
            biases = np.ascontiguousarray(q.biases, dtype="<u2")
            bias_offset = self._pad_within(length, hasher)
            self._write(biases, hasher)
            length = bias_offset + biases.nbytes
            regions.update(bias_offset=bias_offset, bias_length=biases.nbytes)
        entry = {
            "name": name,
            "dtype": q.dtype,
            "shape": header_shape,
            "offset": offset,
            "length": length,
            "group_size": q.group_size,
            "scale_dtype": q.scale_dtype,
            **regions,
        }
        self._finish(entry, hasher, flags, compute_region)

    def add_blocks(
        self,
        name: str,
        raw: np.ndarray,
        block_type: BlockType,
        array_shape: tuple[int, ...],
        *,
        shape: list[int] | None = None,
        flags: int = 0,
        compute_region: str = "cpu",
    ) -> None:
        """Store GGUF quantized blocks as they are (`layout: "gguf_super"`): `raw` holds every row's bytes."""
        if not array_shape or array_shape[-1] % block_type.block_size:
            raise ValueError(
                f"tensor {name!r}: rows of shape {list(array_shape)} do not split into {block_type.name} blocks "
                f"of {block_type.block_size}"
            )
        stored = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
        expected = math.prod(array_shape[:-1]) * block_type.row_bytes(array_shape[-1])
        if stored.nbytes != expected:
            raise ValueError(
                f"tensor {name!r}: {stored.nbytes} bytes of {block_type.name} blocks, expected {expected} "
                f"for shape {list(array_shape)}"
            )
        header_shape, offset = self._begin(name, array_shape, shape, compute_region)
        hasher = xxhash.xxh64()
        self._write(stored, hasher)
        entry = {
            "name": name,
            "dtype": block_type.dtype,
            "shape": header_shape,
            "offset": offset,
            "length": stored.nbytes,
            "group_size": block_type.block_size,
            "layout": BLOCK_LAYOUT,
            "source_ggml_type": block_type.ggml_type,
        }
        self._finish(entry, hasher, flags, compute_region)

    def close(self) -> None:
        """Assemble header and payloads into a temp file, fsync it, and move it onto `path`."""
        if self._finished:
            return
        self._finished = True
        try:
            self._header["tensors"] = self._tensors
            header = json.dumps(self._header, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
            blob_offset = align_up(16 + len(header), BLOB_ALIGN)
            # The temp file is created 0600; a model file gets the usual umask-based mode.
            with atomic_file(self.path, mode=0o666 & ~_current_umask()) as out:
                out.write(MAGIC + struct.pack("<IQ", FORMAT_VERSION, len(header)))
                out.write(header)
                out.write(bytes(blob_offset - 16 - len(header)))
                self._spool.seek(0)
                shutil.copyfileobj(self._spool, out, _COPY_CHUNK)
        finally:
            self._discard_spool()

    def abort(self) -> None:
        """Drop everything written so far; nothing is left at `path`."""
        if self._finished:
            return
        self._finished = True
        self._discard_spool()

    def _begin(
        self,
        name: str,
        array_shape: tuple[int, ...],
        shape: list[int] | None,
        compute_region: str,
    ) -> tuple[list[int], int]:
        """Check a new tensor and align the spool for it; returns its header shape and blob-relative offset."""
        if self._finished:
            raise ValueError(f"tensor {name!r}: writer for {self.path} is already closed")
        if name in self._names:
            raise ValueError(f"duplicate tensor name {name!r}")
        if compute_region not in REGION_ALIGN:
            raise ValueError(
                f"tensor {name!r}: compute_region must be one of {tuple(REGION_ALIGN)}, got {compute_region!r}"
            )
        expected = list(reversed(array_shape)) if self._gguf_order else list(array_shape)
        header_shape = expected if shape is None else [int(dim) for dim in shape]
        if header_shape != expected:
            order = "the reverse of (GGUF order)" if self._gguf_order else "equal to"
            raise ValueError(
                f"tensor {name!r}: header shape {header_shape} must be {order} the array shape {list(array_shape)}"
            )
        self._names.add(name)
        return header_shape, self._pad_spool(REGION_ALIGN[compute_region])

    def _finish(self, entry: dict[str, Any], hasher: xxhash.xxh64, flags: int, compute_region: str) -> None:
        # As BaseRT's tensor entries declare them: the checksum a JSON integer (u64), flags only when set.
        entry["compute_region"] = compute_region
        if flags:
            entry["flags"] = hex(flags)
        entry["checksum_xxh64"] = hasher.intdigest()
        self._tensors.append(entry)

    def _write(self, array: np.ndarray, hasher: xxhash.xxh64) -> None:
        data = array.reshape(-1).view(np.uint8)
        self._spool.write(data)
        hasher.update(data)

    def _pad_spool(self, alignment: int) -> int:
        """Zero-pad the spool (outside any tensor) to `alignment`; returns the new blob-relative offset."""
        position = self._spool.tell()
        aligned = align_up(position, alignment)
        self._spool.write(bytes(aligned - position))
        return aligned

    def _pad_within(self, used: int, hasher: xxhash.xxh64) -> int:
        """Zero-pad inside the current payload (hashed with it); returns the next part's payload-relative offset."""
        aligned = align_up(used, REGION_PART_ALIGN)
        padding = bytes(aligned - used)
        self._spool.write(padding)
        hasher.update(padding)
        return aligned

    def _discard_spool(self) -> None:
        self._spool.close()
        self._spool_path.unlink(missing_ok=True)
