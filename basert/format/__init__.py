"""The `.base` model file format: a JSON header plus aligned tensor payloads, read zero-copy through mmap."""

from __future__ import annotations

from basert.format.errors import (
    BadMagicError,
    BaseFormatError,
    ChecksumMismatchError,
    HeaderOverflowError,
    InvalidHeaderError,
    TensorOutOfBoundsError,
    TruncatedFileError,
    UnknownDtypeError,
    UnsupportedDtypeError,
    UnsupportedVersionError,
)
from basert.format.quant import (
    ALLOWED_GROUP_SIZES,
    DENSE_DTYPES,
    KNOWN_QUANT_DTYPES,
    QUANT_BITS,
    SCALE_DTYPES,
    QuantizedTensor,
    bf16_bits_to_f32,
    dequantize,
    f32_to_bf16_bits,
    from_parts,
    pack_q4,
    quantize,
    round_half_away,
    scale_bits,
    scale_values,
    unpack_q4,
)
from basert.format.reader import BaseFile, TensorInfo, open_base
from basert.format.writer import BaseWriter

__all__ = [
    "ALLOWED_GROUP_SIZES",
    "DENSE_DTYPES",
    "KNOWN_QUANT_DTYPES",
    "QUANT_BITS",
    "SCALE_DTYPES",
    "BadMagicError",
    "BaseFile",
    "BaseFormatError",
    "BaseWriter",
    "ChecksumMismatchError",
    "HeaderOverflowError",
    "InvalidHeaderError",
    "QuantizedTensor",
    "TensorInfo",
    "TensorOutOfBoundsError",
    "TruncatedFileError",
    "UnknownDtypeError",
    "UnsupportedDtypeError",
    "UnsupportedVersionError",
    "bf16_bits_to_f32",
    "dequantize",
    "f32_to_bf16_bits",
    "from_parts",
    "open_base",
    "pack_q4",
    "quantize",
    "round_half_away",
    "scale_bits",
    "scale_values",
    "unpack_q4",
]
