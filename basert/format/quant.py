"""Reference group quantization for `base_q4`/`base_q8` in numpy, exactly as the .base format spec defines it.

The C kernels are checked against these functions, so every step runs in float32 in the spec's order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DENSE_DTYPES = ("f32", "f16", "bf16")
QUANT_BITS = {"base_q4": 4, "base_q8": 8}
KNOWN_QUANT_DTYPES = ("base_q2", "base_q3", "base_q4", "base_q5", "base_q6", "base_q8")
ALLOWED_GROUP_SIZES = (32, 64, 128)
SCALE_DTYPES = ("f16", "bf16")


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns of `x`, rounded to nearest even; NaN stays a (quiet) NaN."""
    f32 = np.ascontiguousarray(x, dtype=np.float32)
    bits = f32.view(np.uint32)
    rounding_bias = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    # NaN payloads can carry into the exponent when rounded, so NaNs are truncated and kept quiet instead.
    rounded = ((bits + rounding_bias) >> np.uint32(16)).astype(np.uint16)
    quiet_nan = ((bits >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return np.where(np.isnan(f32), quiet_nan, rounded)


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 bit patterns (exact)."""
    u16 = np.ascontiguousarray(bits, dtype=np.uint16)
    return (u16.astype(np.uint32) << np.uint32(16)).view(np.float32)


def scale_bits(values: np.ndarray, scale_dtype: str) -> np.ndarray:
    """Raw uint16 bits of `values` rounded (nearest even) to the scale storage dtype `f16` or `bf16`."""
    if scale_dtype == "f16":
        return np.asarray(values, dtype=np.float32).astype(np.float16).view(np.uint16)
    if scale_dtype == "bf16":
        return f32_to_bf16_bits(values)
    raise ValueError(f"scale_dtype must be one of {SCALE_DTYPES}, got {scale_dtype!r}")


def scale_values(bits: np.ndarray, scale_dtype: str) -> np.ndarray:
    """float32 values of raw uint16 scale/bias bits stored as `f16` or `bf16`."""
    if scale_dtype == "f16":
        return np.asarray(bits, dtype=np.uint16).view(np.float16).astype(np.float32)
    if scale_dtype == "bf16":
        return bf16_bits_to_f32(bits)
    raise ValueError(f"scale_dtype must be one of {SCALE_DTYPES}, got {scale_dtype!r}")


def round_half_away(v: np.ndarray) -> np.ndarray:
    """Round to the nearest integer, halves away from zero (C `roundf`), without float32 `x + 0.5` error."""
    whole = np.trunc(v)
    # v - trunc(v) is exact in floating point, so the .5 comparison is exact too.
    return whole + np.where(np.abs(v - whole) >= 0.5, np.sign(v), 0).astype(v.dtype)


def pack_q4(codes: np.ndarray) -> np.ndarray:
    """Pack 4-bit codes two per byte: element 2i in the low nibble, 2i+1 in the high nibble."""
    flat = np.asarray(codes, dtype=np.uint8).reshape(-1)
    if flat.size % 2:
        raise ValueError(f"base_q4 packs pairs of codes, got an odd count {flat.size}")
    if flat.size and int(flat.max()) > 15:
        raise ValueError(f"base_q4 codes must be 0..15, got {int(flat.max())}")
    return flat[0::2] | (flat[1::2] << np.uint8(4))


def unpack_q4(packed: np.ndarray) -> np.ndarray:
    """Unpack bytes into 4-bit codes, low nibble first (the inverse of `pack_q4`)."""
    flat = np.asarray(packed, dtype=np.uint8).reshape(-1)
    codes = np.empty(flat.size * 2, dtype=np.uint8)
    codes[0::2] = flat & np.uint8(0x0F)
    codes[1::2] = flat >> np.uint8(4)
    return codes


# eq=False: a field-wise == on numpy arrays has no single truth value.
@dataclass(slots=True, eq=False)
class QuantizedTensor:
    """A group-quantized tensor as stored in a .base payload; `shape` is row-major numpy order."""

    dtype: str
    shape: tuple[int, ...]
    group_size: int
    scale_dtype: str
    packed: np.ndarray
    scales: np.ndarray
    biases: np.ndarray | None

    def __post_init__(self) -> None:
        if self.dtype not in QUANT_BITS:
            raise ValueError(f"quantized dtype must be one of {tuple(QUANT_BITS)}, got {self.dtype!r}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype must be one of {SCALE_DTYPES}, got {self.scale_dtype!r}")
        _check_grouping(self.shape, self.group_size)
        n = _n_elements(self.shape)
        expected = {
            "packed": (self.packed, np.uint8, n * self.bits // 8),
            "scales": (self.scales, np.uint16, n // self.group_size),
        }
        if self.biases is not None:
            expected["biases"] = (self.biases, np.uint16, n // self.group_size)
        for part, (array, dtype, size) in expected.items():
            if array.dtype != dtype or array.ndim != 1 or array.size != size:
                raise ValueError(
                    f"{part} must be a flat {np.dtype(dtype).name} array of {size} items for "
                    f"{self.dtype} shape {self.shape} group {self.group_size}, "
                    f"got {array.dtype.name} with shape {array.shape}"
                )

    @property
    def bits(self) -> int:
        """Bits per stored code."""
        return QUANT_BITS[self.dtype]

    @property
    def symmetric(self) -> bool:
        """True when there is no bias region (codes are offset by 2^(bits-1))."""
        return self.biases is None


def _n_elements(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def _check_grouping(shape: tuple[int, ...], group_size: int) -> None:
    if group_size <= 0:
        raise ValueError(f"group_size must be positive, got {group_size}")
    if not shape:
        raise ValueError("a quantized tensor needs at least one dimension")
    if shape[-1] % group_size:
        raise ValueError(f"last dimension {shape[-1]} of shape {shape} is not divisible by group_size {group_size}")


def quantize(
    x: np.ndarray,
    dtype: str,
    group_size: int,
    *,
    symmetric: bool = False,
    scale_dtype: str = "f16",
) -> QuantizedTensor:
    """Quantize `x` in groups of `group_size` along its last axis, per the .base format spec."""
    if dtype not in QUANT_BITS:
        raise ValueError(f"quantized dtype must be one of {tuple(QUANT_BITS)}, got {dtype!r}")
    values = np.asarray(x, dtype=np.float32)
    _check_grouping(values.shape, group_size)
    if not np.isfinite(values).all():
        raise ValueError("cannot quantize non-finite values")
    bits = QUANT_BITS[dtype]
    groups = values.reshape(-1, group_size)

    if symmetric:
        half = 1 << (bits - 1)
        absmax = np.abs(groups).max(axis=1)
        scales_bits, scale = _stored_scale(absmax / np.float32(half - 1), scale_dtype)
        codes = np.clip(round_half_away(groups / scale[:, None]), -half, half - 1) + half
        biases_bits = None
    else:
        low = groups.min(axis=1)
        scales_bits, scale = _stored_scale((groups.max(axis=1) - low) / np.float32((1 << bits) - 1), scale_dtype)
        biases_bits = scale_bits(low, scale_dtype)
        bias = scale_values(biases_bits, scale_dtype)
        if not np.isfinite(bias).all():
            raise ValueError(f"a group minimum overflows {scale_dtype} biases")
        codes = np.clip(round_half_away((groups - bias[:, None]) / scale[:, None]), 0, (1 << bits) - 1)

    codes = codes.astype(np.uint8).reshape(-1)
    return QuantizedTensor(
        dtype=dtype,
        shape=tuple(values.shape),
        group_size=group_size,
        scale_dtype=scale_dtype,
        packed=pack_q4(codes) if bits == 4 else codes,
        scales=scales_bits,
        biases=biases_bits,
    )


def _stored_scale(scale: np.ndarray, scale_dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Round scales to storage first; a zero (or underflowed) scale becomes 1.0 so division stays defined."""
    rounded = scale_values(scale_bits(scale, scale_dtype), scale_dtype)
    rounded = np.where(rounded == 0, np.float32(1.0), rounded)
    if not np.isfinite(rounded).all():
        raise ValueError(f"a group's range overflows {scale_dtype} scales")
    return scale_bits(rounded, scale_dtype), rounded


def dequantize(q: QuantizedTensor) -> np.ndarray:
    """float32 values of `q`: `code * scale + bias`, or `(code - 2^(bits-1)) * scale` when symmetric."""
    codes = unpack_q4(q.packed) if q.bits == 4 else np.asarray(q.packed)
    codes = codes.astype(np.float32).reshape(-1, q.group_size)
    scale = scale_values(q.scales, q.scale_dtype)[:, None]
    if q.biases is None:
        values = (codes - np.float32(1 << (q.bits - 1))) * scale
    else:
        # Multiply then add as two float32 roundings, matching gguf-py's `d * q + m` bit for bit.
        values = codes * scale + scale_values(q.biases, q.scale_dtype)[:, None]
    return values.reshape(q.shape)


def from_parts(
    dtype: str,
    shape: tuple[int, ...] | list[int],
    group_size: int,
    scale_dtype: str,
    packed: np.ndarray,
    scales: np.ndarray,
    biases: np.ndarray | None,
) -> QuantizedTensor:
    """A QuantizedTensor from already packed codes and raw uint16 scale/bias bits (e.g. a lossless GGUF mapping)."""
    return QuantizedTensor(
        dtype=dtype,
        shape=tuple(int(dim) for dim in shape),
        group_size=int(group_size),
        scale_dtype=scale_dtype,
        packed=np.asarray(packed).reshape(-1),
        scales=np.asarray(scales).reshape(-1),
        biases=None if biases is None else np.asarray(biases).reshape(-1),
    )
