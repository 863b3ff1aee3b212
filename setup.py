"""Builds the native CPU expert executor (native/_ftnative) as part of `pip install`.

Everything else about the package lives in pyproject.toml. The extension is plain C++17 against
pybind11 (no libtorch, no -march=native: it picks its SIMD path at run time), so one build serves
every torch version and every x86-64 CPU. If it cannot be compiled (no C++ compiler), the install
still succeeds with a warning and the engine falls back to the torch executor, unless
FREETOKEN_REQUIRE_NATIVE=1 is set (CI sets it), which turns the failure into an error.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def _native_flags() -> list[str]:
    """The compile flags of native/build.py (one list for both builds), loaded by path: a module
    named `build` may also exist in the build environment."""
    spec = importlib.util.spec_from_file_location("_ft_native_build", Path(__file__).resolve().parent / "native" / "build.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return list(mod.FLAGS)


SOURCES = sorted(str(p.as_posix()) for p in Path("native/src").glob("*.cpp"))


def _pybind11_include() -> str:
    import pybind11

    return pybind11.get_include()


class NativeBuildExt(build_ext):
    def build_extension(self, ext: Extension) -> None:
        ext.include_dirs.append(_pybind11_include())
        try:
            super().build_extension(ext)
        except Exception as exc:
            if os.environ.get("FREETOKEN_REQUIRE_NATIVE") == "1":
                raise
            print(f"WARNING: the native expert executor was not built ({exc}); the engine will use the "
                  "torch executor. Install a C++17 compiler and reinstall to get it.", file=sys.stderr)


native = Extension(
    "native._ftnative",
    sources=SOURCES,
    depends=[str(p.as_posix()) for p in Path("native/src").glob("*.h")],
    language="c++",
    extra_compile_args=[*_native_flags(), "-O3", "-DNDEBUG"],
    extra_link_args=["-pthread"],
)

setup(ext_modules=[native], cmdclass={"build_ext": NativeBuildExt})
