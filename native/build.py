"""Build the native CPU expert executor: native/build/_ftnative<EXT_SUFFIX>.

Usage: python native/build.py [--debug] [--cxx g++]

Compiles native/src/*.cpp with the system C++ compiler and pybind11's headers (`pip install pybind11`).
No libtorch, no OpenMP, no -march=native: the .so targets baseline x86-64 and picks its SIMD path at
run time (AVX-512-BF16 / AVX-512F / AVX2+FMA / scalar), so it can be copied to another x86-64 machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

NATIVE_DIR = Path(__file__).resolve().parent
SRC_DIR = NATIVE_DIR / "src"
BUILD_DIR = NATIVE_DIR / "build"
MODULE = "_ftnative"


def output_path() -> Path:
    return BUILD_DIR / f"{MODULE}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"


def build(debug: bool = False, cxx: str | None = None, verbose: bool = True) -> Path:
    try:
        import pybind11
    except ImportError as exc:
        raise RuntimeError("pybind11 is required to build the native executor: pip install pybind11") from exc
    cxx = cxx or os.environ.get("CXX") or "g++"
    if shutil.which(cxx) is None:
        raise RuntimeError(f"C++ compiler {cxx!r} not found")
    sources = sorted(str(p) for p in SRC_DIR.glob("*.cpp"))
    if not sources:
        raise RuntimeError(f"no sources in {SRC_DIR}")
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    out = output_path()
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    flags = ["-O0", "-g"] if debug else ["-O3", "-DNDEBUG"]
    cmd = [
        cxx,
        "-std=c++17",
        *flags,
        "-shared",
        "-fPIC",
        "-pthread",
        "-fvisibility=hidden",
        "-Wall",
        "-Wextra",
        "-Wno-unused-parameter",
        "-Wno-maybe-uninitialized",
        "-Wno-uninitialized",  # GCC 12 _mm512_undefined_*
        f"-I{pybind11.get_include()}",
        f"-I{sysconfig.get_paths()['include']}",
        *sources,
        "-o",
        str(tmp),
    ]
    if verbose:
        print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    os.replace(tmp, out)  # atomic: a process that already loaded the old .so keeps its mapping
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--debug", action="store_true", help="-O0 -g instead of -O3")
    ap.add_argument("--cxx", default=None, help="C++ compiler (default $CXX or g++)")
    args = ap.parse_args()
    try:
        path = build(debug=args.debug, cxx=args.cxx)
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        print(f"build failed: {exc}", file=sys.stderr)
        return 1
    print(f"built {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
