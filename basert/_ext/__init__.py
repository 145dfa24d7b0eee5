"""Compiled kernels (Cython + C), built once per CPU variant; the best one this CPU runs is chosen here.

Every module of basert/_ext/<variant>/ is importable as basert._ext.<module> (`from basert._ext import matmul`).
The environment variable BASERT_CPU=portable|avx2|avx512 picks a variant instead. The variants give the same
bits on every input: they only differ in speed. No policy here.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
from pathlib import Path

from basert._ext.cpu import NEEDS, VARIANTS, best_variant, cpu_flags, cpu_supports

_HERE = Path(__file__).parent


class CPUVariantError(ImportError):
    """BASERT_CPU names a variant that does not exist, was not built, or this CPU cannot run."""


def module_names(variant: str = "portable") -> list[str]:
    """The kernel modules built for a variant (one per basert/_ext/*.pyx)."""
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    return sorted({p.name.split(".", 1)[0] for p in (_HERE / variant).iterdir() if p.name.endswith(suffixes)})


def built_variants() -> list[str]:
    """The variants whose kernels are installed, whatever this CPU runs."""
    return [v for v in VARIANTS if module_names(v)]


def supported_variants() -> list[str]:
    """The variants that are built and that this CPU runs, slowest first."""
    return [v for v in built_variants() if cpu_supports(v)]


def _choose() -> str:
    wanted = os.environ.get("BASERT_CPU", "").strip()
    if not wanted:
        usable = supported_variants()
        if not usable:
            raise CPUVariantError(f"no kernels are built in {_HERE}: run `python setup.py build_ext --inplace`")
        if usable[-1] != best_variant():
            # An install built elsewhere, or with BASERT_BUILD_VARIANTS: it runs, only slower than it could.
            print(f"basert: this CPU runs the {best_variant()} kernels, but this install has only "
                  f"{', '.join(built_variants())}: using {usable[-1]} (reinstall here, or build with "
                  "BASERT_BUILD_VARIANTS=all)", file=sys.stderr)
        return usable[-1]
    if wanted not in VARIANTS:
        raise CPUVariantError(f"BASERT_CPU={wanted!r}: the variants are {', '.join(VARIANTS)}")
    if not cpu_supports(wanted):
        missing = " ".join(sorted(NEEDS[wanted] - cpu_flags()))
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
