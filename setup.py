"""Builds the Cython kernels in basert/_ext with -O3, OpenMP and no debug information: one package per CPU variant.

basert/_ext/<variant>/<module>.so for every basert/_ext/<module>.pyx, where <variant> is
  portable  no x86 SIMD flags (plain C, fmaf),
  avx2      -mavx2 -mfma -mf16c,
  avx512    the avx2 flags and -mavx512f -mavx512bw -mavx512vl.
By default a build compiles portable and the best variant the building CPU runs (an install is for the machine
that builds it); BASERT_BUILD_VARIANTS=all compiles every variant the compiler accepts (a wheel for other
machines, CI), and BASERT_BUILD_VARIANTS=portable,avx2 (a comma-separated list) just those, portable always.
basert/_ext/__init__.py picks the best built variant this CPU runs at import (BASERT_CPU overrides it).

The C kernels that several modules call (basert/_ext/kernels/*.c, declared in basert/_ext/*.h) are compiled once
per variant into a static library of that variant, which each of its modules links: the linker takes the units a
module calls, and their symbols stay hidden in it. Every unit (the kernel units and the Cython-generated modules of
every variant) is compiled by one pool, a job per core, the largest first; each prints one line with its time, on
the terminal when there is one (pip shows a build's own output only with -v), else on stderr. A unit is recompiled
when it or a header it includes changed.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError

EXT_DIR = Path("basert") / "_ext"
KERNEL_DIR = EXT_DIR / "kernels"
# The package's own CPU detection, read without importing the package (its kernels are what is being built).
CPU = runpy.run_path(str(EXT_DIR / "cpu.py"))
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
    # Hidden symbols: a module exports only its PyInit_ function, so the kernel units each module links stay its own.
    compile_args = ["-O3", "-g0", "-fvisibility=hidden", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"]
    link_args: list[str] = []
    if compiler_accepts(["-fopenmp"], "#include <omp.h>\nint main(void){return omp_get_max_threads()<0;}\n"):
        compile_args.append("-fopenmp")
        link_args.append("-fopenmp")
    return compile_args, link_args


def headers(path: Path, seen: set[Path] | None = None) -> set[Path]:
    """The basert/_ext headers and .pxd files that a .pyx, .pxd, .c or .h file uses, directly or through another (an
    #include is looked for next to the file, then in basert/_ext; a cimport from basert._ext is its .pxd)."""
    seen = set() if seen is None else seen
    text = path.read_text()
    found = [next((folder / name for folder in (path.parent, EXT_DIR) if (folder / name).exists()), None)
             for name in re.findall(r'(?:extern from|#include) "([^"]+\.h)"', text)]
    found += [EXT_DIR / f"{name}.pxd" for name in re.findall(r"from basert\._ext\.(\w+) cimport", text)]
    for header in found:
        if header is not None and header.exists() and header not in seen:
            seen.add(header)
            headers(header, seen)
    return seen


# What the build says about the variants (which it compiles, which not and why): printed when it compiles, not at
# each of the several times a PEP 517 front end runs this file.
VARIANT_NOTES: list[str] = []


def progress(line: str) -> None:
    """One line of the build's progress: on the terminal when there is one (pip captures a build's output and shows
    it only with -v, so a long compile would look hung), otherwise on stderr (CI logs, `pip install -v`)."""
    line = f"basert build: {line}\n"
    try:
        with open("/dev/tty", "w") as tty:
            tty.write(line)
            return
    except OSError:
        pass
    sys.stderr.write(line)
    sys.stderr.flush()


def extensions() -> list[Extension]:
    compile_args, link_args = common_flags()
    # Cython writes basert/_ext/<module>.c once; every variant compiles it.
    generated = cythonize(
        [Extension(".".join(pyx.with_suffix("").parts), [str(pyx)]) for pyx in sorted(EXT_DIR.glob("*.pyx"))],
        compiler_directives=CYTHON_DIRECTIVES,
        nthreads=os.cpu_count() or 1,
    )
    kernels = sorted(KERNEL_DIR.glob("*.c"))
    # What a module's build reads: its .pyx's headers, the kernel units and theirs (setuptools' depends: an sdist
    # ships them).
    kernel_depends = set(kernels).union(*(headers(unit) for unit in kernels))
    modules = []
    try:
        wanted = CPU["variants_to_build"](os.environ.get("BASERT_BUILD_VARIANTS"))
    except ValueError as exc:
        sys.exit(f"basert build: {exc}")
    for variant, (flags, macros) in VARIANTS.items():
        if variant not in wanted:
            why = ("not in BASERT_BUILD_VARIANTS" if os.environ.get("BASERT_BUILD_VARIANTS")
                   else "this CPU does not run it; BASERT_BUILD_VARIANTS=all builds every variant")
            VARIANT_NOTES.append(f"{variant}: not built ({why})")
            continue
        if flags and not compiler_accepts(flags):
            VARIANT_NOTES.append(f"{variant}: the compiler rejects {' '.join(flags)}, not built")
            continue
        VARIANT_NOTES.append(f"{variant}: compile {' '.join(compile_args + flags)}")
        for ext in generated:
            c_source = Path(ext.sources[0])
            modules.append(
                Extension(
                    f"basert._ext.{variant}.{c_source.stem}",
                    # The module first; the kernel units go into the variant's library (BuildExt).
                    [str(c_source), *map(str, kernels)],
                    include_dirs=[numpy.get_include(), str(EXT_DIR)],
                    extra_compile_args=compile_args + flags,
                    extra_link_args=link_args,
                    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"), *macros],
                    depends=sorted(map(str, headers(c_source.with_suffix(".pyx")) | kernel_depends)),
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


def up_to_date(target: Path, sources: list[Path]) -> bool:
    return target.exists() and all(source.stat().st_mtime <= target.stat().st_mtime for source in sources)


class BuildExt(build_ext):
    """Compiles every unit of every extension in one pool of `-j` jobs (one per core by default), the kernel units
    once per variant, then links each module with its variant's kernel library. Each compile prints one progress
    line: `basert build: [3/14] avx2 matmul_q4.c 12.3 s (12.1 s CPU)` (wall, and CPU: user + system)."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if not self.parallel:
            self.parallel = os.cpu_count() or 1

    def build_extensions(self) -> None:
        self.check_extensions_list(self.extensions)
        # object file -> (the extension whose flags compile it, its source): a variant's kernel units once.
        units: dict[Path, tuple[Extension, Path]] = {}
        for ext in self.extensions:
            for source in map(Path, ext.sources):
                units.setdefault(self.object_file(ext, source), (ext, source))
        stale = [obj for obj, (_, source) in units.items()
                 if self.force or not up_to_date(obj, [source, *headers(source)])]
        # The largest first: the Cython modules (6 to 12 s each on a Zen 3), larger generated sources first, then the
        # kernel units (1 to 10 s), which fill every core to the end.
        stale.sort(key=lambda obj: (units[obj][1].parent == KERNEL_DIR, -units[obj][1].stat().st_size))
        for note in VARIANT_NOTES:
            progress(note)
        self._lock = threading.Lock()
        self._compiled = 0
        with ThreadPoolExecutor(self.parallel) as pool:
            list(pool.map(lambda obj: self.compile_unit(obj, *units[obj], len(stale)), stale))
        for ext in self.extensions:
            library = self.kernel_library(ext)
            self.compiler.link_shared_object(
                [str(self.object_file(ext, Path(ext.sources[0]))), str(library)], self.get_ext_fullpath(ext.name),
                libraries=self.get_libraries(ext), extra_postargs=ext.extra_link_args,
                export_symbols=self.get_export_symbols(ext), build_temp=self.build_temp, target_lang="c")

    def object_file(self, ext: Extension, source: Path) -> Path:
        """build/temp.../<variant>/<source path>.o: each variant's objects apart."""
        return Path(self.build_temp) / ext.name.split(".")[-2] / source.with_suffix(".o")

    def kernel_library(self, ext: Extension) -> Path:
        """The static library of the kernel units of ext's variant, archived anew when one of them changed."""
        objects = [self.object_file(ext, Path(source)) for source in ext.sources[1:]]
        library = Path(self.build_temp) / ext.name.split(".")[-2] / "libbasert_kernels.a"
        with self._lock:
            if not up_to_date(library, objects):
                library.unlink(missing_ok=True)
                self.compiler.create_static_lib(list(map(str, objects)), "basert_kernels", str(library.parent))
        return library

    def compile_unit(self, obj: Path, ext: Extension, source: Path, count: int) -> None:
        """Compiles one source with ext's flags (the command distutils would run)."""
        obj.parent.mkdir(parents=True, exist_ok=True)
        command = [*self.compiler.compiler_so,
                   *(f"-D{name}={value}" for name, value in ext.define_macros),
                   *(f"-I{folder}" for folder in ext.include_dirs + self.compiler.include_dirs),
                   "-c", str(source), "-o", str(obj), *ext.extra_compile_args]
        start = time.perf_counter()
        cpu = run_compiler(command)
        with self._lock:
            self._compiled += 1
            progress(f"[{self._compiled}/{count}] {ext.name.split('.')[-2]} {source.name} "
                     f"{time.perf_counter() - start:.1f} s ({cpu:.1f} s CPU)")


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildExt})
