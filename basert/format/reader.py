"""Reads `.base` files through a read-only mmap: the header is validated on open and tensors are
returned as zero-copy numpy views of the mapped payloads.

On open every tensor entry must describe exactly the bytes its shape, dtype and group size need,
at an offset aligned for its compute region, inside the file and overlapping no other tensor.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import xxhash

from basert.format import quant
from basert.format.errors import (
    BadMagicError,
    ChecksumMismatchError,
    HeaderOverflowError,
    InvalidHeaderError,
    TensorOutOfBoundsError,
    TruncatedFileError,
    UnknownDtypeError,
    UnsupportedDtypeError,
    UnsupportedVersionError,
)
from basert.format.ggml_blocks import BLOCK_LAYOUT, BLOCK_TYPES, BlockType, dequantize_blocks
from basert.format.quant import (
    ALLOWED_GROUP_SIZES,
    DENSE_DTYPES,
    KNOWN_QUANT_DTYPES,
    QUANT_BITS,
    SCALE_DTYPES,
    QuantizedTensor,
)
from basert.format.writer import ALIGNMENT, BLOB_ALIGN, FORMAT_VERSION, MAGIC, REGION_PART_ALIGN, align_up

_DENSE_NUMPY = {"f32": np.dtype("<f4"), "f16": np.dtype("<f2"), "bf16": np.dtype("<u2")}
_REQUIRED_HEADER = {"arch": str, "config": dict, "tokenizer": dict, "tensors": list}
# The header's alignment key that sets the offset alignment of each compute region.
_REGION_ALIGN_KEY = {"accelerator": "accel_align_log2", "gpu": "gpu_page_log2", "cpu": "cpu_align_log2"}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor entry of the header; `offset` is absolute in the file, the region offsets are payload-relative."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    array_shape: tuple[int, ...]
    offset: int
    length: int
    group_size: int | None
    scale_dtype: str | None
    scale_offset: int | None
    scale_length: int | None
    bias_offset: int | None
    bias_length: int | None
    flags: int
    compute_region: str
    checksum: int | None
    block_type: BlockType | None = None  # GGUF blocks kept as they are (layout "gguf_super")

    @property
    def n_elements(self) -> int:
        """Number of values in the tensor."""
        return math.prod(self.shape)

    @property
    def is_quantized(self) -> bool:
        """True for the group-quantized `base_q*` dtypes in their own layout (packed values, scales, biases)."""
        return self.dtype in QUANT_BITS and self.block_type is None

    @property
    def storage(self) -> str:
        """How the values are stored: the dtype, or the GGUF block type of blocks kept as they are ("Q4_K")."""
        return self.block_type.name if self.block_type is not None else self.dtype

    @property
    def is_blocks(self) -> bool:
        """True for GGUF quantized blocks kept as they are."""
        return self.block_type is not None

    @property
    def symmetric(self) -> bool:
        """True for a quantized tensor without a bias region."""
        return self.is_quantized and self.bias_offset is None


class BaseFile:
    """An open `.base` file; use as a context manager or call `close()`."""

    def __init__(self, path: str | os.PathLike[str], *, verify_checksums: bool = False) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self.file_size = os.fstat(f.fileno()).st_size
            if self.file_size < 16:
                raise TruncatedFileError(f"{self.path}: {self.file_size} bytes is shorter than the 16-byte preamble")
            self._mmap: mmap.mmap | None = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self.header = self._read_header()
            self.arch: str = self.header["arch"]
            self.config: dict[str, Any] = self.header["config"]
            self.tokenizer: dict[str, Any] = self.header["tokenizer"]
            source = self.header.get("source")
            self.source_format: str | None = source.get("format") if isinstance(source, dict) else None
            self.tensors = self._read_tensors()
            if verify_checksums:
                self.verify_checksums()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> BaseFile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Unmap the file; views still alive keep the mapping until they are garbage collected."""
        if self._mmap is None:
            return
        try:
            self._mmap.close()
        except BufferError:
            pass
        self._mmap = None

    def pop_tokenizer(self) -> dict[str, Any]:
        """The header's tokenizer object, no longer kept here (`tokenizer` becomes empty): a vocabulary parsed into
        Python objects holds megabytes that a server which has built its Tokenizer from it never reads again."""
        tokenizer, self.tokenizer = self.tokenizer, {}
        self.header.pop("tokenizer", None)
        return tokenizer

    def verify_checksums(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Hash every tensor that records a checksum, in one call on a view of the mapping (no copy);
        `progress(done_bytes, total_bytes)` is called after each tensor."""
        checked = [info for info in self.tensors.values() if info.checksum is not None]
        total = sum(info.length for info in checked)
        done = 0
        with memoryview(self._mapped()) as mapped:
            for info in checked:
                with mapped[info.offset : info.offset + info.length] as payload:
                    digest = xxhash.xxh64_intdigest(payload)
                if digest != info.checksum:
                    raise ChecksumMismatchError(
                        f"{self.path}: tensor {info.name!r} hashes to {digest:016x}, "
                        f"header records {info.checksum:016x}"
                    )
                done += info.length
                if progress is not None:
                    progress(done, total)

    def payload(self, name: str) -> np.ndarray:
        """Read-only uint8 view of a tensor's whole payload."""
        info = self._info(name)
        return self._view(info.offset, info.length, np.uint8)

    def release(self, name: str, start: int = 0, stop: int | None = None) -> None:
        """Let the pages of bytes [start, stop) of a tensor's payload (all of it by default) go from this process's
        memory, whole pages only (those shared with the bytes around stay): for bytes read once into a copy. A later
        read maps them in again from the file."""
        info = self._info(name)
        end = info.length if stop is None else min(stop, info.length)
        start = -(-(info.offset + start) // mmap.PAGESIZE) * mmap.PAGESIZE
        stop = (info.offset + end) // mmap.PAGESIZE * mmap.PAGESIZE
        if stop > start:
            self._mapped().madvise(mmap.MADV_DONTNEED, start, stop - start)

    def array(self, name: str) -> np.ndarray:
        """Read-only view of a dense tensor shaped `array_shape` (bf16 comes back as uint16 raw bits)."""
        info = self._info(name)
        if info.dtype not in DENSE_DTYPES:
            raise ValueError(f"{self.path}: tensor {name!r} is {info.dtype}, not a dense dtype; use quantized()")
        return self._view(info.offset, info.n_elements, _DENSE_NUMPY[info.dtype]).reshape(info.array_shape)

    def packed(self, name: str) -> np.ndarray:
        """Read-only flat uint8 view of a quantized tensor's packed codes."""
        info = self._quantized_info(name)
        return self._view(info.offset, info.n_elements * QUANT_BITS[info.dtype] // 8, np.uint8)

    def scales(self, name: str) -> np.ndarray:
        """Read-only flat view of a quantized tensor's scales as raw uint16 bits."""
        info = self._quantized_info(name)
        return self._view(info.offset + info.scale_offset, info.n_elements // info.group_size, np.dtype("<u2"))

    def biases(self, name: str) -> np.ndarray | None:
        """Read-only flat view of a quantized tensor's biases as raw uint16 bits; None when symmetric."""
        info = self._quantized_info(name)
        if info.bias_offset is None:
            return None
        return self._view(info.offset + info.bias_offset, info.n_elements // info.group_size, np.dtype("<u2"))

    def quantized(self, name: str) -> QuantizedTensor:
        """A QuantizedTensor (shape in row-major order) made of zero-copy views."""
        info = self._quantized_info(name)
        return QuantizedTensor(
            dtype=info.dtype,
            shape=info.array_shape,
            group_size=info.group_size,
            scale_dtype=info.scale_dtype,
            packed=self.packed(name),
            scales=self.scales(name),
            biases=self.biases(name),
        )

    def dequantize(self, name: str) -> np.ndarray:
        """A new float32 array of the tensor's values (numpy reference path)."""
        info = self._info(name)
        if info.block_type is not None:
            return dequantize_blocks(self.payload(name), info.block_type, info.array_shape)
        if info.is_quantized:
            return quant.dequantize(self.quantized(name))
        values = self.array(name)
        if info.dtype == "bf16":
            return quant.bf16_bits_to_f32(values).reshape(info.array_shape)
        return values.astype(np.float32)

    def _mapped(self) -> mmap.mmap:
        if self._mmap is None:
            raise ValueError(f"{self.path} is closed")
        return self._mmap

    def _view(self, offset: int, count: int, dtype: np.dtype | type) -> np.ndarray:
        return np.frombuffer(self._mapped(), dtype=dtype, count=count, offset=offset)

    def _info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None

    def _quantized_info(self, name: str) -> TensorInfo:
        info = self._info(name)
        if not info.is_quantized:
            raise ValueError(f"{self.path}: tensor {name!r} is {info.dtype}, not quantized; use array()")
        return info

    def _read_header(self) -> dict[str, Any]:
        data = self._mapped()
        magic = bytes(data[0:4])
        if magic != MAGIC:
            raise BadMagicError(f"{self.path}: magic is {magic!r}, expected {MAGIC!r}")
        version, header_len = struct.unpack_from("<IQ", data, 4)
        if version != FORMAT_VERSION:
            raise UnsupportedVersionError(
                f"{self.path}: format_version {version} is not supported (only {FORMAT_VERSION} is)"
            )
        if 16 + header_len > self.file_size:
            raise HeaderOverflowError(
                f"{self.path}: header_len {header_len} runs past end of file (size {self.file_size})"
            )
        try:
            header = json.loads(bytes(data[16 : 16 + header_len]).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise InvalidHeaderError(f"{self.path}: header is not UTF-8 JSON: {error}") from None
        # Read once: its pages (megabytes for a vocabulary of 150k pieces) need not stay in this process's memory.
        header_pages = (16 + header_len) // mmap.PAGESIZE * mmap.PAGESIZE
        if header_pages:
            data.madvise(mmap.MADV_DONTNEED, 0, header_pages)
        if not isinstance(header, dict):
            raise InvalidHeaderError(f"{self.path}: header is a JSON {type(header).__name__}, expected an object")
        for key, kind in _REQUIRED_HEADER.items():
            if not isinstance(header.get(key), kind):
                raise InvalidHeaderError(f"{self.path}: header key {key!r} is missing or not a JSON {kind.__name__}")
        self.blob_offset = align_up(16 + header_len, BLOB_ALIGN)
        if self.blob_offset > self.file_size:
            raise TruncatedFileError(
                f"{self.path}: blob_offset {self.blob_offset} is past end of file (size {self.file_size})"
            )
        return header

    def _read_tensors(self) -> dict[str, TensorInfo]:
        gguf_order = self.source_format == "gguf"
        region_align = self._region_alignment()
        tensors: dict[str, TensorInfo] = {}
        for entry in self.header["tensors"]:
            info = self._tensor_info(entry, gguf_order)
            if info.name in tensors:
                raise InvalidHeaderError(f"{self.path}: tensor {info.name!r} appears twice in the header")
            self._check_regions(info)
            align = region_align[info.compute_region]
            if (info.offset - self.blob_offset) % align:
                raise TensorOutOfBoundsError(
                    f"{self.path}: tensor {info.name!r} offset {info.offset - self.blob_offset} is not a multiple "
                    f"of {align}, the alignment of compute_region {info.compute_region!r}"
                )
            tensors[info.name] = info
        # In offset order, the first tensor to cross end of file shows whether the file was cut short, and each
        # tensor must start at or after the end of the one before it.
        previous: TensorInfo | None = None
        for info in sorted(tensors.values(), key=lambda info: info.offset):
            end = info.offset + info.length
            if end > self.file_size:
                if info.offset < self.file_size:
                    raise TruncatedFileError(
                        f"{self.path}: file ends at {self.file_size} inside tensor {info.name!r} "
                        f"(bytes {info.offset}..{end})"
                    )
                raise TensorOutOfBoundsError(
                    f"{self.path}: tensor {info.name!r} at bytes {info.offset}..{end} lies past end of file "
                    f"(size {self.file_size})"
                )
            if previous is not None and info.offset < previous.offset + previous.length:
                raise TensorOutOfBoundsError(
                    f"{self.path}: tensor {info.name!r} at bytes {info.offset}..{end} overlaps tensor "
                    f"{previous.name!r} at bytes {previous.offset}..{previous.offset + previous.length}"
                )
            previous = info
        return tensors

    def _region_alignment(self) -> dict[str, int]:
        """Offset alignment in bytes per compute region, from the header's `alignment` (spec defaults if absent)."""
        declared = self.header.get("alignment", ALIGNMENT)
        if not isinstance(declared, dict):
            raise InvalidHeaderError(f"{self.path}: header key 'alignment' {declared!r} is not a JSON object")
        alignment = {}
        for region, key in _REGION_ALIGN_KEY.items():
            log2 = declared.get(key, ALIGNMENT[key])
            if not _is_count(log2) or log2 > 30:
                raise InvalidHeaderError(f"{self.path}: alignment {key} {log2!r} is not a power-of-two exponent")
            alignment[region] = 1 << log2
        return alignment

    def _tensor_info(self, entry: Any, gguf_order: bool) -> TensorInfo:
        if not isinstance(entry, dict):
            raise InvalidHeaderError(f"{self.path}: tensor entry {entry!r} is not a JSON object")
        name = entry.get("name")
        for key in ("name", "dtype", "shape", "offset", "length"):
            if key not in entry:
                raise InvalidHeaderError(f"{self.path}: tensor {name!r} has no {key!r}")
        if not isinstance(name, str):
            raise InvalidHeaderError(f"{self.path}: tensor name {name!r} is not a string")
        dtype = entry["dtype"]
        if dtype not in DENSE_DTYPES and dtype not in KNOWN_QUANT_DTYPES:
            raise UnknownDtypeError(f"{self.path}: tensor {name!r} has unknown dtype {dtype!r}")
        block_type = self._block_type(entry)
        if block_type is None and dtype not in DENSE_DTYPES and dtype not in QUANT_BITS:
            raise UnsupportedDtypeError(
                f"{self.path}: tensor {name!r} has dtype {dtype!r}, which this reader does not support "
                f"(supported: {', '.join(DENSE_DTYPES + tuple(QUANT_BITS))}, and GGUF blocks with layout "
                f"{BLOCK_LAYOUT!r})"
            )
        shape = entry["shape"]
        if not isinstance(shape, list) or not all(_is_count(dim) for dim in shape):
            raise InvalidHeaderError(f"{self.path}: tensor {name!r} shape {shape!r} is not a list of counts")
        quantized = block_type is None and dtype in QUANT_BITS
        scale_dtype = entry.get("scale_dtype", "f16") if quantized else None
        if quantized and scale_dtype not in SCALE_DTYPES:
            raise InvalidHeaderError(f"{self.path}: tensor {name!r} has scale_dtype {scale_dtype!r}")
        integer_keys = ["offset", "length"]
        if quantized:
            integer_keys += ["group_size", "scale_offset", "scale_length"]
        integer_keys += [key for key in ("bias_offset", "bias_length") if quantized and key in entry]
        for key in integer_keys:
            if not _is_count(entry.get(key)):
                raise InvalidHeaderError(f"{self.path}: tensor {name!r} {key} {entry.get(key)!r} is not a count")
        if ("bias_offset" in entry) != ("bias_length" in entry):
            raise InvalidHeaderError(f"{self.path}: tensor {name!r} has only one of bias_offset/bias_length")
        compute_region = entry.get("compute_region", "gpu")
        if compute_region not in _REGION_ALIGN_KEY:
            raise InvalidHeaderError(
                f"{self.path}: tensor {name!r} compute_region {compute_region!r} is not one of "
                f"{', '.join(_REGION_ALIGN_KEY)}"
            )
        return TensorInfo(
            name=name,
            dtype=dtype,
            shape=tuple(shape),
            array_shape=tuple(reversed(shape)) if gguf_order else tuple(shape),
            offset=self.blob_offset + entry["offset"],
            length=entry["length"],
            group_size=entry["group_size"] if quantized else block_type.block_size if block_type else None,
            scale_dtype=scale_dtype,
            scale_offset=entry["scale_offset"] if quantized else None,
            scale_length=entry["scale_length"] if quantized else None,
            bias_offset=entry.get("bias_offset") if quantized else None,
            bias_length=entry.get("bias_length") if quantized else None,
            flags=self._parse_hex(entry.get("flags", 0), f"tensor {name!r} flags"),
            compute_region=compute_region,
            checksum=(
                None
                if entry.get("checksum_xxh64") is None
                else self._parse_hex(entry["checksum_xxh64"], f"tensor {name!r} checksum_xxh64")
            ),
            block_type=block_type,
        )

    def _block_type(self, entry: dict[str, Any]) -> BlockType | None:
        """The GGUF block type of a tensor kept in GGUF's blocks (layout "gguf_super"); None for row-major."""
        name, layout = entry["name"], entry.get("layout")
        if layout is None:
            return None
        if layout != BLOCK_LAYOUT:
            raise UnsupportedDtypeError(
                f"{self.path}: tensor {name!r} has layout {layout!r}, which this reader does not support "
                f"(supported: row-major, {BLOCK_LAYOUT!r})"
            )
        code = entry.get("source_ggml_type")
        block_type = BLOCK_TYPES.get(code) if _is_count(code) else None
        if block_type is None:
            known = ", ".join(f"{bt.name} {bt.ggml_type}" for bt in BLOCK_TYPES.values())
            raise UnsupportedDtypeError(
                f"{self.path}: tensor {name!r} has source_ggml_type {code!r}, which this reader does not support "
                f"(supported: {known})"
            )
        group_size = entry.get("group_size", block_type.block_size)
        if entry["dtype"] != block_type.dtype or group_size != block_type.block_size:
            raise InvalidHeaderError(
                f"{self.path}: tensor {name!r} holds {block_type.name} blocks, which are dtype {block_type.dtype!r} "
                f"with group_size {block_type.block_size}, not {entry['dtype']!r} with {group_size!r}"
            )
        return block_type

    def _check_regions(self, info: TensorInfo) -> None:
        """The payload must hold exactly what the shape, dtype and group size need: dense values, or packed
        values, then scales, then biases, each region right after the previous one (padded to at most
        REGION_PART_ALIGN bytes)."""
        where = f"{self.path}: tensor {info.name!r}"
        if info.block_type is not None:
            bt = info.block_type
            if not info.array_shape or info.array_shape[-1] % bt.block_size:
                raise InvalidHeaderError(
                    f"{where} rows of shape {list(info.array_shape)} do not split into {bt.name} blocks "
                    f"of {bt.block_size}"
                )
            needed = info.n_elements // info.array_shape[-1] * bt.row_bytes(info.array_shape[-1])
            if info.length != needed:
                raise TensorOutOfBoundsError(
                    f"{where} length {info.length} does not match the {needed} bytes of {bt.name} {list(info.shape)}"
                )
            return
        if not info.is_quantized:
            needed = info.n_elements * _DENSE_NUMPY[info.dtype].itemsize
            if info.length != needed:
                raise TensorOutOfBoundsError(
                    f"{where} length {info.length} does not match the {needed} bytes of {info.dtype} {list(info.shape)}"
                )
            return
        if info.group_size not in ALLOWED_GROUP_SIZES:
            raise InvalidHeaderError(
                f"{where} group_size {info.group_size} is not one of {', '.join(map(str, ALLOWED_GROUP_SIZES))}"
            )
        if not info.array_shape or info.array_shape[-1] % info.group_size:
            raise InvalidHeaderError(
                f"{where} rows of shape {list(info.array_shape)} do not split into groups of {info.group_size}"
            )
        group_bytes = info.n_elements // info.group_size * 2
        end, before = info.n_elements * QUANT_BITS[info.dtype] // 8, "packed values"
        regions = [("scale region", info.scale_offset, info.scale_length)]
        if info.bias_offset is not None:
            regions.append(("bias region", info.bias_offset, info.bias_length))
        for region, start, size in regions:
            latest = align_up(end, REGION_PART_ALIGN)
            if not end <= start <= latest:
                expected = str(end) if latest == end else f"{end}..{latest}"
                raise TensorOutOfBoundsError(
                    f"{where} {region} starts at {start}, expected {expected} (right after the {before})"
                )
            if size != group_bytes:
                raise TensorOutOfBoundsError(
                    f"{where} {region} holds {size} bytes, expected {group_bytes} for "
                    f"{info.dtype} {list(info.shape)} in groups of {info.group_size}"
                )
            end, before = start + size, region
        if info.length != end:
            raise TensorOutOfBoundsError(f"{where} length {info.length} does not match the {end} bytes of its regions")

    def _parse_hex(self, value: Any, what: str) -> int:
        """Flags and checksums are stored as hex strings (with or without 0x) or, by some writers, as ints."""
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value, 16)
            except ValueError:
                pass
        raise InvalidHeaderError(f"{self.path}: {what} {value!r} is not a hex string or integer")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def open_base(path: str | os.PathLike[str], verify_checksums: bool = False) -> BaseFile:
    """Open a `.base` file (see BaseFile)."""
    return BaseFile(path, verify_checksums=verify_checksums)
