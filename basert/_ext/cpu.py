"""Which kernel variants this CPU runs, and which ones a build compiles: read by the package at import and by
setup.py at build time, so it imports nothing but the standard library."""

from __future__ import annotations

import platform
from pathlib import Path

VARIANTS = ("portable", "avx2", "avx512")   # slowest first
# The CPU flags (as /proc/cpuinfo names them) each variant's instructions need.
NEEDS = {
    "portable": frozenset(),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "avx512": frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"}),
}


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (none off x86-64, or where /proc/cpuinfo cannot be read)."""
    if platform.machine().lower() not in {"x86_64", "amd64"}:
        return frozenset()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_supports(variant: str) -> bool:
    """Whether this CPU has the instructions the variant's kernels use."""
    return NEEDS[variant] <= cpu_flags()


def best_variant() -> str:
    """The fastest variant this CPU runs."""
    return [variant for variant in VARIANTS if cpu_supports(variant)][-1]


def variants_to_build(wanted: str | None) -> list[str]:
    """The variants a build compiles for BASERT_BUILD_VARIANTS=`wanted`: unset or empty, portable and the best one
    this CPU runs; "all", every variant (a wheel for other machines); else the comma-separated list, with
    portable always. ValueError names a variant that does not exist."""
    if not wanted or not wanted.strip():
        return sorted({"portable", best_variant()}, key=VARIANTS.index)
    names = {name.strip() for name in wanted.split(",") if name.strip()}
    if names == {"all"}:
        return list(VARIANTS)
    unknown = sorted(names - set(VARIANTS))
    if unknown:
        raise ValueError(f"BASERT_BUILD_VARIANTS: unknown variant {', '.join(unknown)} "
                         f"(the variants are {', '.join(VARIANTS)}, or all)")
    return [variant for variant in VARIANTS if variant in names | {"portable"}]
