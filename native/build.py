"""Developer build of the native CPU expert executor, in place: native/_ftnative<EXT_SUFFIX>.

Usage: python native/build.py [--debug] [--cxx g++] [-j N] [--force] [--emulate-avx512 DIR]

`pip install` builds the same extension through setup.py; this script is the quick rebuild while
working on the C++ (each source compiled in parallel, then linked; an object newer than its source
and every header is kept unless --force or the flags changed). Same flags: C++17, pybind11's
headers, no libtorch, no OpenMP, no -march=native (the SIMD path is chosen at run time).

`--emulate-avx512 DIR` builds a test module instead, DIR/native/_ftnative<EXT_SUFFIX> beside a copy
of native/'s Python files: compiled for AVX2 with FT_EMULATE_AVX512, its AVX-512 kernels run on
SIMDe's emulation (the `simde-py` package's headers), so the AVX-512 paths can be tested on any AVX2
machine (tests/native/test_emulated_avx512.py). Never an install: it is slow.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

NATIVE_DIR = Path(__file__).resolve().parent
SRC_DIR = NATIVE_DIR / "src"
OBJ_DIR = NATIVE_DIR / "build" / "obj"
MODULE = "_ftnative"
FLAGS = ["-std=c++17", "-fPIC", "-pthread", "-fvisibility=hidden", "-Wall", "-Wextra", "-Wno-unused-parameter",
         "-Wno-uninitialized", "-Wno-maybe-uninitialized"]


def output_path() -> Path:
    return NATIVE_DIR / f"{MODULE}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"


def _local_deps(src: Path) -> set[Path]:
    """src and the headers of src/ it includes, transitively."""
    seen: set[Path] = set()
    todo = [src]
    while todo:
        p = todo.pop()
        if p in seen or not p.exists():
            continue
        seen.add(p)
        todo += [SRC_DIR / m for m in re.findall(r'^#include "([^"]+)"', p.read_text(), re.MULTILINE)]
    return seen


def _emulation_flags() -> list[str]:
    try:
        import simde_py  # type: ignore[import-untyped]
    except ImportError as exc:
        raise RuntimeError("the AVX-512 emulation needs SIMDe's headers: pip install simde-py") from exc
    # -O1 (after the build's -O3): the same results, in under half the compile time of SIMDe's code
    return ["-O1", "-DFT_EMULATE_AVX512", "-mavx2", "-mfma", "-mf16c", f"-I{simde_py.get_include()}",
            "-Wno-unused-function", "-Wno-unused-variable", "-Wno-psabi"]


def build(debug: bool = False, cxx: str | None = None, jobs: int = 0, verbose: bool = True,
          force: bool = False, emulate_avx512: Path | None = None) -> Path:
    try:
        import pybind11
    except ImportError as exc:
        raise RuntimeError("pybind11 is required to build the native executor: pip install pybind11") from exc
    cxx = cxx or os.environ.get("CXX") or "g++"
    if shutil.which(cxx) is None:
        raise RuntimeError(f"C++ compiler {cxx!r} not found")
    sources = sorted(SRC_DIR.glob("*.cpp"))
    if not sources:
        raise RuntimeError(f"no sources in {SRC_DIR}")
    obj_dir = OBJ_DIR if emulate_avx512 is None else OBJ_DIR.with_name("obj-emulate-avx512")
    obj_dir.mkdir(parents=True, exist_ok=True)
    opt = ["-O0", "-g"] if debug else ["-O3", "-DNDEBUG"]
    if emulate_avx512 is not None:
        opt += _emulation_flags()
    inc = [f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}"]
    stamp = obj_dir / "flags.txt"
    flags_text = " ".join([cxx, *FLAGS, *opt, *inc])
    if not stamp.exists() or stamp.read_text() != flags_text:
        force = True

    def compile_one(src: Path) -> Path:
        obj = obj_dir / (src.stem + ".o")
        if not force and obj.exists() and obj.stat().st_mtime > max(p.stat().st_mtime for p in _local_deps(src)):
            return obj
        cmd = [cxx, *FLAGS, *opt, *inc, "-c", str(src), "-o", str(obj)]
        if verbose:
            print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        return obj

    with ThreadPoolExecutor(jobs or os.cpu_count() or 1) as pool:
        objs = list(pool.map(compile_one, sources))
    stamp.write_text(flags_text)
    out = output_path()
    if emulate_avx512 is not None:
        pkg = Path(emulate_avx512) / "native"
        pkg.mkdir(parents=True, exist_ok=True)
        for py in NATIVE_DIR.glob("*.py"):
            shutil.copyfile(py, pkg / py.name)
        out = pkg / out.name
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    subprocess.run([cxx, "-shared", "-pthread", *map(str, objs), "-o", str(tmp), "-ldl"], check=True)
    os.replace(tmp, out)  # atomic: a process that already loaded the old .so keeps its mapping
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--debug", action="store_true", help="-O0 -g instead of -O3")
    ap.add_argument("--cxx", default=None, help="C++ compiler (default $CXX or g++)")
    ap.add_argument("-j", "--jobs", type=int, default=0, help="parallel compiles (default: CPU count)")
    ap.add_argument("--force", action="store_true", help="recompile every source")
    ap.add_argument("--emulate-avx512", type=Path, default=None, metavar="DIR",
                    help="build the AVX-512-on-SIMDe test module into DIR/native instead")
    args = ap.parse_args()
    try:
        path = build(debug=args.debug, cxx=args.cxx, jobs=args.jobs, force=args.force,
                     emulate_avx512=args.emulate_avx512)
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        print(f"build failed: {exc}", file=sys.stderr)
        return 1
    print(f"built {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
