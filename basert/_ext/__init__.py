"""Compiled kernels (Cython + C), built once per CPU variant; the best one this CPU runs is chosen here.

Every module of basert/_ext/<variant>/ is importable as basert._ext.<module> (`from basert._ext import matmul`).
The environment variable BASERT_CPU=portable|avx2|avx512 picks a variant instead. The variants give the same
bits on every input: they only differ in speed. No policy here.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import platform
import sys
from pathlib import Path

VARIANTS = ("portable", "avx2", "avx512")
# The CPU flags (as /proc/cpuinfo names them) each variant's instructions need.
_NEEDS = {
    "portable": frozenset(),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "avx512": frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"}),
}
_HERE = Path(__file__).parent


class CPUVariantError(ImportError):
    """BASERT_CPU names a variant that does not exist, was not built, or this CPU cannot run."""


def _cpu_flags() -> frozenset[str]:
    if platform.machine().lower() not in {"x86_64", "amd64"}:
        return frozenset()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def module_names(variant: str = "portable") -> list[str]:
    """The kernel modules built for a variant (one per basert/_ext/*.pyx)."""
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    return sorted({p.name.split(".", 1)[0] for p in (_HERE / variant).iterdir() if p.name.endswith(suffixes)})


def built_variants() -> list[str]:
    """The variants whose kernels are installed, whatever this CPU runs."""
    return [v for v in VARIANTS if module_names(v)]


def cpu_supports(variant: str) -> bool:
    """Whether this CPU has the instructions the variant's kernels use."""
    return _NEEDS[variant] <= _cpu_flags()


def supported_variants() -> list[str]:
    """The variants that are built and that this CPU runs, slowest first."""
    return [v for v in built_variants() if cpu_supports(v)]


def _choose() -> str:
    wanted = os.environ.get("BASERT_CPU", "").strip()
    if not wanted:
        usable = supported_variants()
        if not usable:
            raise CPUVariantError(f"no kernels are built in {_HERE}: run `python setup.py build_ext --inplace`")
        return usable[-1]
    if wanted not in VARIANTS:
        raise CPUVariantError(f"BASERT_CPU={wanted!r}: the variants are {', '.join(VARIANTS)}")
    if not cpu_supports(wanted):
        missing = " ".join(sorted(_NEEDS[wanted] - _cpu_flags()))
        raise CPUVariantError(f"BASERT_CPU={wanted}: this CPU lacks {missing}")
    if not module_names(wanted):
        raise CPUVariantError(f"BASERT_CPU={wanted}: that variant was not built (built: {', '.join(built_variants())})")
    return wanted


VARIANT = _choose()

for _name in module_names(VARIANT):
    _module = importlib.import_module(f"{__name__}.{VARIANT}.{_name}")
    sys.modules[f"{__name__}.{_name}"] = _module
    globals()[_name] = _module
del _name, _module
