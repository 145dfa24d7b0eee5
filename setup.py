"""Builds the Cython kernels in basert/_ext with -O3, OpenMP and AVX2/FMA/F16C where available.

Set BASERT_PORTABLE=1 to force the scalar build (no x86 SIMD flags).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

EXT_DIR = Path("basert") / "_ext"
SIMD_FLAGS = ["-mavx2", "-mfma", "-mf16c"]
SIMD_CPU_FLAGS = {"avx2", "fma", "f16c"}


def compiler_accepts(flags: list[str], source: str = "int main(void){return 0;}\n") -> bool:
    """True when the C compiler compiles and links a small program with these flags."""
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.c"
        src.write_text(source)
        result = subprocess.run(
            [compiler, *flags, str(src), "-o", str(Path(tmp) / "probe")],
            capture_output=True,
        )
        return result.returncode == 0


def cpu_has_simd() -> bool:
    if platform.machine().lower() not in {"x86_64", "amd64"}:
        return False
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return SIMD_CPU_FLAGS <= set(line.split(":", 1)[1].split())
    return False


def build_flags() -> tuple[list[str], list[str], list[tuple[str, str]]]:
    compile_args = ["-O3", "-fno-math-errno", "-fno-trapping-math"]
    link_args: list[str] = []
    macros: list[tuple[str, str]] = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
    if compiler_accepts(["-fopenmp"], "#include <omp.h>\nint main(void){return omp_get_max_threads()<0;}\n"):
        compile_args.append("-fopenmp")
        link_args.append("-fopenmp")
    portable = os.environ.get("BASERT_PORTABLE", "") not in {"", "0"}
    if not portable and cpu_has_simd() and compiler_accepts(SIMD_FLAGS):
        compile_args += SIMD_FLAGS
        macros.append(("BASERT_SIMD", "1"))
    print(f"basert build: compile {' '.join(compile_args)}", file=sys.stderr)
    return compile_args, link_args, macros


def extensions() -> list[Extension]:
    compile_args, link_args, macros = build_flags()
    modules = []
    for pyx in sorted(EXT_DIR.glob("*.pyx")):
        name = ".".join(pyx.with_suffix("").parts)
        modules.append(
            Extension(
                name,
                [str(pyx)],
                include_dirs=[numpy.get_include(), str(EXT_DIR)],
                extra_compile_args=compile_args,
                extra_link_args=link_args,
                define_macros=macros,
            )
        )
    return cythonize(
        modules,
        compiler_directives={
            "language_level": "3",
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": False,
            # Plain builtin functions: cProfile then attributes time to each kernel (tools/profile_decode.py).
            "binding": False,
        },
    )


setup(ext_modules=extensions())
