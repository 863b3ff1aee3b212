#!/usr/bin/env bash
# fetch_source.sh - get the peer's (llama.cpp's) source and pack it for the GPU machine.
#
# Contract (runs on the development machine, with network access to PyPI):
#   evals/peer/fetch_source.sh [--no-verify] [--no-wheels]
#   - downloads the sdist of llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION (default below) with
#     `pip download --no-binary :all: --no-deps` (or takes the file named by $SDIST), extracts its
#     vendor/llama.cpp and keeps only what building llama-bench, llama-quantize and llama-server
#     with CUDA needs (an allowlist; tools/CMakeLists.txt is replaced by one that adds only those tools);
#   - writes PEER_VERSION (llama.cpp commit, sdist version) into the tree and packs it as
#     .peer/llama.cpp.tar.xz in the repository root (gitignored), printing its size;
#   - unless --no-verify: configures the packed tree with -DGGML_CUDA=OFF and builds llama-bench and
#     llama-quantize for the CPU in .peer-cpu/build (gitignored, never carried), proving the trimmed
#     tree builds; .peer-cpu/build/bin/llama-bench is the CPU binary the local tests of run_bench.py
#     use, .peer-cpu/build/bin/llama-quantize the one of tests/engine/test_peer_requantize.py.
#     VERIFY_SERVER=1 also builds llama-server there;
#   - unless --no-wheels: downloads the pure-python `gguf` wheel into .whl/ (gitignored) for
#     write_gguf.py on the GPU machine (no network there; its image has numpy and pyyaml, gguf's
#     import-time needs, and requests/tqdm, which gguf imports only lazily).
# Exits non-zero on any failure. Needs: python3 with pip (or $PYTHON), tar, xz, cmake, ninja, a C++ compiler.
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
GGUF_VERSION="${GGUF_VERSION:-0.19.0}"
PY="${PYTHON:-python3}"

VERIFY=1
WHEELS=1
for arg in "$@"; do
    case "$arg" in
        --no-verify) VERIFY=0 ;;
        --no-wheels) WHEELS=0 ;;
        -h|--help) awk 'NR > 1 && /^set -euo/ {exit} NR > 1' "$0"; exit 0 ;;
        *) echo "fetch_source.sh: unknown argument: $arg" >&2; exit 2 ;;
    esac
done

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PEER_DIR="$REPO/.peer"
TARBALL="$PEER_DIR/llama.cpp.tar.xz"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

die() { echo "fetch_source.sh: $*" >&2; exit 1; }
"$PY" -m pip --version >/dev/null 2>&1 || die "$PY has no pip; set PYTHON to an interpreter with pip"

# 1. the sdist
if [[ -n "${SDIST:-}" ]]; then
    [[ -f "$SDIST" ]] || die "SDIST=$SDIST does not exist"
    cp "$SDIST" "$WORK/"
else
    echo "== pip download llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION (sdist)"
    "$PY" -m pip download --no-binary :all: --no-deps -d "$WORK" \
        "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
fi
SDIST_FILE="$(ls "$WORK"/llama_cpp_python-*.tar.gz)"
TOP="llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION"
echo "== extracting $TOP/vendor/llama.cpp from $(basename "$SDIST_FILE")"
tar -xzf "$SDIST_FILE" -C "$WORK" "$TOP/vendor/llama.cpp" "$TOP/.git/modules/vendor/llama.cpp/HEAD" "$TOP/.git/HEAD"
SRC="$WORK/$TOP/vendor/llama.cpp"
LLAMA_COMMIT="$(tr -d '[:space:]' < "$WORK/$TOP/.git/modules/vendor/llama.cpp/HEAD")"
SDIST_COMMIT="$(tr -d '[:space:]' < "$WORK/$TOP/.git/HEAD")"
[[ "$LLAMA_COMMIT" =~ ^[0-9a-f]{40}$ ]] || die "could not read the llama.cpp submodule commit (got '$LLAMA_COMMIT')"

# 2. the allowlist
[[ -f "$SRC/tools/llama-bench/llama-bench.cpp" ]] || die "tools/llama-bench not found in this llama.cpp version"
grep -q -- '--allow-requantize' "$SRC/tools/quantize/quantize.cpp" || die "this llama-quantize has no --allow-requantize"
grep -q -- '--n-cpu-moe' "$SRC/tools/llama-bench/llama-bench.cpp" || die "this llama-bench has no --n-cpu-moe"
grep -q -- '--load-mode' "$SRC/tools/llama-bench/llama-bench.cpp" \
    || echo "fetch_source.sh: WARNING: this llama-bench has no --load-mode: give run_bench.py --load-mode '' --extra '-mmp 0'" >&2
DST="$WORK/llama.cpp"
mkdir -p "$DST"
keep() {  # keep PATH... (relative to the llama.cpp root; each must exist)
    local p
    for p in "$@"; do
        [[ -e "$SRC/$p" ]] || die "expected $p in the vendored llama.cpp"
        mkdir -p "$DST/$(dirname "$p")"
        cp -a "$SRC/$p" "$DST/$p"
    done
}
keep CMakeLists.txt LICENSE licenses cmake include src common vendor \
     ggml/CMakeLists.txt ggml/cmake ggml/include ggml/src/ggml-cpu ggml/src/ggml-cuda \
     tools/llama-bench tools/quantize tools/server tools/cli tools/mtmd \
     tools/ui/CMakeLists.txt tools/ui/sources.cmake tools/ui/ui.cpp.in tools/ui/ui.h.in \
     scripts/ui-assets.cmake models/ggml-vocab-qwen2.gguf
# ggml/src: every top-level file (the core library), no backend directories besides cpu and cuda
find "$SRC/ggml/src" -maxdepth 1 -type f -exec cp -a {} "$DST/ggml/src/" \;
# documentation and tests inside the kept directories are not built
find "$DST" \( \( -name '*.md' ! -name 'LICENSE*' \) -o -name tests \) -prune -exec rm -rf {} +
rm -rf "$DST/tools/server/bench" "$DST/tools/mtmd/legacy-models" "$DST"/tools/mtmd/test-*.*

cat > "$DST/tools/CMakeLists.txt" <<'CMAKE'
# Replaced by freetoken-agent's evals/peer/fetch_source.sh: the peer benchmark builds only
# llama-bench and llama-quantize, and with LLAMA_BUILD_SERVER also llama-server / llama-cli (which
# need mtmd and ui).
find_package(Threads REQUIRED)

llama_add_compile_flags()

add_subdirectory(llama-bench)
add_subdirectory(quantize)
if (LLAMA_BUILD_SERVER)
    add_subdirectory(ui)
    add_subdirectory(cli)
    add_subdirectory(server)
    add_subdirectory(mtmd)
endif()
CMAKE

cat > "$DST/PEER_VERSION" <<VERSION
llama_cpp_commit=$LLAMA_COMMIT
llama_cpp_python_version=$LLAMA_CPP_PYTHON_VERSION
llama_cpp_python_commit=$SDIST_COMMIT
packed_utc=$(date -u +%Y-%m-%dT%H:%M:%SZ)
VERSION

# 3. pack
mkdir -p "$PEER_DIR"
tar -C "$WORK" --owner=0 --group=0 --sort=name -cf - llama.cpp | xz -T0 -9 > "$TARBALL.tmp"
mv "$TARBALL.tmp" "$TARBALL"
SIZE=$(stat -c %s "$TARBALL")
echo "== packed $TARBALL: $SIZE bytes ($(awk -v s="$SIZE" 'BEGIN{printf "%.2f", s/1048576}') MiB)," \
     "llama.cpp $LLAMA_COMMIT (llama-cpp-python $LLAMA_CPP_PYTHON_VERSION)"
(( SIZE < 40 * 1048576 )) || die "tarball is $SIZE bytes, over 40 MiB"

# 4. verify: the packed tree builds llama-bench and llama-quantize for the CPU
if (( VERIFY )); then
    CPU="$REPO/.peer-cpu"
    rm -rf "$CPU/llama.cpp"
    mkdir -p "$CPU"
    tar -xJf "$TARBALL" -C "$CPU"
    TARGETS=(llama-bench llama-quantize)
    SERVER=OFF
    if [[ "${VERIFY_SERVER:-0}" == 1 ]]; then TARGETS+=(llama-server); SERVER=ON; fi
    echo "== verify: configure (GGML_CUDA=OFF) and build ${TARGETS[*]} in $CPU/build"
    GIT_CEILING_DIRECTORIES="$CPU" cmake -S "$CPU/llama.cpp" -B "$CPU/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DGGML_CUDA=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
        -DLLAMA_BUILD_SERVER=$SERVER -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
        -DLLAMA_BUILD_COMMIT="${LLAMA_COMMIT:0:9}" >"$CPU/configure.log" 2>&1 \
        || { tail -40 "$CPU/configure.log" >&2; die "cmake configure of the trimmed tree failed"; }
    ninja -C "$CPU/build" -j"${JOBS:-$(nproc)}" "${TARGETS[@]}" >"$CPU/build.log" 2>&1 \
        || { tail -40 "$CPU/build.log" >&2; die "building the trimmed tree failed"; }
    "$CPU/build/bin/llama-bench" --help | grep -E -- '--n-cpu-moe|--load-mode'
    { "$CPU/build/bin/llama-quantize" --help 2>&1 || true; } | grep -- '--allow-requantize'  # usage exits 1
    echo "== verify ok: $CPU/build/bin/llama-bench, $CPU/build/bin/llama-quantize"
fi

# 5. wheels for write_gguf.py on the GPU machine (no network there)
if (( WHEELS )); then
    echo "== wheel into $REPO/.whl: gguf==$GGUF_VERSION (pure python)"
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 -d "$REPO/.whl" "gguf==$GGUF_VERSION"
    ls -la "$REPO/.whl" | grep -i gguf
fi
