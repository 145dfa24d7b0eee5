"""Builds the Cython kernels in basert/_ext with -O3, OpenMP and no debug information: one package per CPU variant.

basert/_ext/<variant>/<module>.so for every basert/_ext/<module>.pyx, where <variant> is
  portable  no x86 SIMD flags (plain C, fmaf),
  avx2      -mavx2 -mfma -mf16c,
  avx512    the avx2 flags and -mavx512f -mavx512bw -mavx512vl.
By default a build compiles portable and the best variant the building CPU runs (an install is for the machine
that builds it); BASERT_BUILD_VARIANTS=all compiles every variant the compiler accepts (a wheel for other
machines, CI), and BASERT_BUILD_VARIANTS=portable,avx2 (a comma-separated list) just those, portable always.
basert/_ext/__init__.py picks the best built variant this CPU runs at import (BASERT_CPU overrides it).
"""

from __future__ import annotations

import os
import re
import runpy
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError

EXT_DIR = Path("basert") / "_ext"
# The package's own CPU detection, read without importing the package (its kernels are what is being built).
CPU = runpy.run_path(str(EXT_DIR / "cpu.py"))
# Each variant compiles its own copy of a generated .c (a wrapper that #includes it): setuptools puts an
# object file at a path derived from its source path, so variants sharing one source would collide.
WRAPPER_DIR = Path("build") / "variants"
AVX2_FLAGS = ["-mavx2", "-mfma", "-mf16c"]
# variant -> (compile flags, macros); BASERT_SIMD selects the AVX2 code of the headers, BASERT_AVX512 the zmm code.
VARIANTS: dict[str, tuple[list[str], list[tuple[str, str]]]] = {
    "portable": ([], []),
    "avx2": (AVX2_FLAGS, [("BASERT_SIMD", "1")]),
    "avx512": (AVX2_FLAGS + ["-mavx512f", "-mavx512bw", "-mavx512vl"], [("BASERT_SIMD", "1"), ("BASERT_AVX512", "1")]),
}
CYTHON_DIRECTIVES = {
    "language_level": "3",
    "boundscheck": False,
    "wraparound": False,
    "cdivision": True,
    "initializedcheck": False,
    # Plain builtin functions: cProfile then attributes time to each kernel (tools/profile_decode.py).
    "binding": False,
}


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


def common_flags() -> tuple[list[str], list[str]]:
    # No FMA contraction: a*b+c stays two roundings in every variant, so scalar code gives the same bits on all.
    # No debug information (-g0 overrides the -g of Python's CFLAGS): for the fully unrolled kernels it costs a third
    # of the compile time (avx2 matmul.c on a Zen 3: 182 s with it, 120 s without) and changes no instruction.
    compile_args = ["-O3", "-g0", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"]
    link_args: list[str] = []
    if compiler_accepts(["-fopenmp"], "#include <omp.h>\nint main(void){return omp_get_max_threads()<0;}\n"):
        compile_args.append("-fopenmp")
        link_args.append("-fopenmp")
    return compile_args, link_args


def headers(path: Path, seen: set[Path] | None = None) -> set[Path]:
    """The basert/_ext headers that a .pyx or .h file uses, directly or through another header."""
    seen = set() if seen is None else seen
    for name in re.findall(r'(?:extern from|#include) "([^"]+\.h)"', path.read_text()):
        header = EXT_DIR / name
        if header.exists() and header not in seen:
            seen.add(header)
            headers(header, seen)
    return seen


def wrapper(variant: str, c_source: Path) -> str:
    """A source file of its own for this variant's copy of a generated module."""
    path = WRAPPER_DIR / variant / c_source.name
    path.parent.mkdir(parents=True, exist_ok=True)
    text = f'#include "{os.path.relpath(c_source, path.parent)}"\n'
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return str(path)


def extensions() -> list[Extension]:
    compile_args, link_args = common_flags()
    # Cython writes basert/_ext/<module>.c once; every variant compiles it.
    generated = cythonize(
        [Extension(".".join(pyx.with_suffix("").parts), [str(pyx)]) for pyx in sorted(EXT_DIR.glob("*.pyx"))],
        compiler_directives=CYTHON_DIRECTIVES,
    )
    modules = []
    # setuptools rebuilds an extension when one of its depends is newer than it: the .pyx's headers count.
    depends = {str(ext.sources[0]): sorted(str(h) for h in headers(Path(ext.sources[0]).with_suffix(".pyx")))
               for ext in generated}
    try:
        wanted = CPU["variants_to_build"](os.environ.get("BASERT_BUILD_VARIANTS"))
    except ValueError as exc:
        sys.exit(f"basert build: {exc}")
    for variant, (flags, macros) in VARIANTS.items():
        if variant not in wanted:
            why = ("not in BASERT_BUILD_VARIANTS" if os.environ.get("BASERT_BUILD_VARIANTS")
                   else "this CPU does not run it; BASERT_BUILD_VARIANTS=all builds every variant")
            print(f"basert build: {variant}: not built ({why})", file=sys.stderr)
            continue
        if flags and not compiler_accepts(flags):
            print(f"basert build: {variant}: the compiler rejects {' '.join(flags)}, not built", file=sys.stderr)
            continue
        print(f"basert build: {variant}: compile {' '.join(compile_args + flags)}", file=sys.stderr)
        for ext in generated:
            c_source = Path(ext.sources[0])
            modules.append(
                Extension(
                    f"basert._ext.{variant}.{c_source.stem}",
                    [wrapper(variant, c_source)],
                    include_dirs=[numpy.get_include(), str(EXT_DIR)],
                    extra_compile_args=compile_args + flags,
                    extra_link_args=link_args,
                    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"), *macros],
                    depends=[str(c_source), *depends[str(c_source)]],
                )
            )
    return modules


def run_compiler(command: list[str]) -> float:
    """Runs one compiler command; returns the CPU seconds (user + system) it took."""
    process = subprocess.Popen(command)
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise CompileError(f"{' '.join(command)}: exit code {process.returncode}")
    return usage.ru_utime + usage.ru_stime


class ParallelBuildExt(build_ext):
    """build_ext compiling one extension per core unless -j says otherwise. Each unit's compile prints one line on
    stderr with its variant, source and seconds (wall, and CPU: user + system), the progress `pip install -v .`
    shows: `basert build: [3/12] avx2 matmul.c 95.1 s (94.8 s CPU)`."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if not self.parallel:
            self.parallel = os.cpu_count() or 1

    def build_extensions(self) -> None:
        self._lock = threading.Lock()
        self._compiled = 0
        super().build_extensions()

    def build_extension(self, ext: Extension) -> None:
        ext_path = Path(self.get_ext_fullpath(ext.name))
        if not self.force and ext_path.exists() and all(
                Path(f).stat().st_mtime <= ext_path.stat().st_mtime for f in ext.sources + ext.depends):
            return
        objects = [self.compile_unit(ext, Path(source)) for source in ext.sources]
        self.compiler.link_shared_object(
            objects, str(ext_path), libraries=self.get_libraries(ext), extra_postargs=ext.extra_link_args,
            export_symbols=self.get_export_symbols(ext), build_temp=self.build_temp, target_lang="c")

    def compile_unit(self, ext: Extension, source: Path) -> str:
        """Compiles one source of an extension (the command distutils would run); returns its object file."""
        obj = Path(self.build_temp) / source.with_suffix(".o")
        obj.parent.mkdir(parents=True, exist_ok=True)
        command = [*self.compiler.compiler_so,
                   *(f"-D{name}={value}" for name, value in ext.define_macros),
                   *(f"-I{folder}" for folder in ext.include_dirs + self.compiler.include_dirs),
                   "-c", str(source), "-o", str(obj), *ext.extra_compile_args]
        start = time.perf_counter()
        cpu = run_compiler(command)
        with self._lock:
            self._compiled += 1
            print(f"basert build: [{self._compiled}/{len(self.extensions)}] {ext.name.split('.')[-2]} {source.name} "
                  f"{time.perf_counter() - start:.1f} s ({cpu:.1f} s CPU)", file=sys.stderr, flush=True)
        return str(obj)


setup(ext_modules=extensions(), cmdclass={"build_ext": ParallelBuildExt})
