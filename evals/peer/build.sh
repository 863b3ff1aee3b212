#!/usr/bin/env bash
# build.sh - build the peer (llama.cpp's llama-bench, optionally llama-quantize and llama-server) with CUDA on
# the GPU machine.
#
# Contract (runs in the repository root of the GPU machine's copy; no network needed):
#   bash evals/peer/build.sh [--server] [--quantize] [--export] [--force]
#   - input: .peer/llama.cpp.tar.xz (made by fetch_source.sh; carry the FILE `.peer/llama.cpp.tar.xz`,
#     not the folder `.peer`, or a later carry would replace .peer/bin there);
#   - extracts it to $LLAMA_CPP_DIR (default /tmp/llama.cpp), configures it in $BUILD_DIR (default
#     /tmp/llama.cpp-build) with CUDA for sm_$CUDA_ARCH (default 90), static llama/ggml libraries, no
#     curl/openssl/nccl/UI downloads, and builds llama-bench (plus llama-server with --server and
#     llama-quantize with --quantize) with ninja -j$JOBS (default 16);
#   - strips the binaries into .peer/bin/ (gitignored) with a stamp (sha256 of the tarball + targets):
#     a later call on the same warm machine that finds a matching stamp skips the build (--force rebuilds);
#     checks that they link (ldd) and that llama-bench sees a CUDA device;
#   - --export (and $OUT set): writes each binary `xz -T$JOBS -6` compressed and split into pieces of
#     15 MiB as $OUT/NAME.xz.part-NN, plus $OUT/peer-bin.sha256, llama-bench first, skipping (with a
#     warning) a binary that would pass $EXPORT_BUDGET_MIB (default 60) MiB or 8 files in all: the
#     CUDA llama-bench alone is ~40 MiB compressed; $EXPORT_ONLY (names, space-separated, e.g.
#     llama-server) exports only those; llama-quantize is left out of the export unless EXPORT_ONLY
#     names it (it is only needed on the machine that writes the GGUF). evals/peer/restore.sh DIR reassembles them into
#     .peer/bin/ on any machine. On a failed build with $OUT set, the log goes to
#     $OUT/peer-build.log.gz.
#   - prints the time of every step; any failure exits non-zero with the reason and the log's tail.
#   - cuBLAS and the driver library: when the CUDA toolkit lacks them (a toolkit assembled from pip
#     wheels), cuBLAS is taken from python's nvidia-cublas wheel ($PYTHON, default python3) or
#     ldconfig, and libcuda from the installed driver; with no libcuda at all it builds with
#     GGML_CUDA_NO_VMM=ON and says so.
#   - PEER_CUDA=OFF (only for testing this script on a machine without CUDA) builds for the CPU instead.
#   - PEER_CMAKE_ARGS: more cmake options, word-split (part of the stamp). For a build made on another
#     machine (CUDA from pip wheels on PATH, no GPU), name the GPU host's CPU instead of -march=native:
#     "-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON ..."; the check that
#     llama-bench sees a CUDA device then fails there, after the binary is in .peer/bin.
set -euo pipefail

T_START=$(date +%s.%N)
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
TARBALL="$REPO/.peer/llama.cpp.tar.xz"
BIN_DIR="$REPO/.peer/bin"
SRC="${LLAMA_CPP_DIR:-/tmp/llama.cpp}"
BUILD="${BUILD_DIR:-/tmp/llama.cpp-build}"
JOBS="${JOBS:-16}"
CUDA_ARCH="${CUDA_ARCH:-90}"
PEER_CUDA="${PEER_CUDA:-ON}"

SERVER=0
QUANTIZE=0
EXPORT=0
FORCE=0
for arg in "$@"; do
    case "$arg" in
        --server) SERVER=1 ;;
        --quantize) QUANTIZE=1 ;;
        --export) EXPORT=1 ;;
        --force) FORCE=1 ;;
        -h|--help) awk 'NR > 1 && /^set -euo/ {exit} NR > 1' "$0"; exit 0 ;;
        *) echo "build.sh: unknown argument: $arg" >&2; exit 2 ;;
    esac
done
TARGETS=(llama-bench)
(( SERVER )) && TARGETS+=(llama-server)
(( QUANTIZE )) && TARGETS+=(llama-quantize)

die() { echo "build.sh: FAILED: $*" >&2; exit 1; }
step_t0=0
step() { step_t0=$(date +%s.%N); echo "== [build.sh] $*"; }
step_done() { echo "   [build.sh] $1: $(awk -v a="$step_t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s"; }
save_log() {  # save_log LOG: keep a failed build's log where it comes back
    if [[ -n "${OUT:-}" && -d "${OUT:-}" ]]; then gzip -c "$1" > "$OUT/peer-build.log.gz" || true; fi
}

# 0. tools
step "checking tools"
if ! command -v nvcc >/dev/null 2>&1; then
    for d in /usr/local/cuda/bin /usr/local/cuda-13*/bin /usr/local/cuda-12*/bin; do
        if [[ -x "$d/nvcc" ]]; then export PATH="$d:$PATH"; break; fi
    done
fi
for tool in cmake ninja xz strip sha256sum; do
    command -v "$tool" >/dev/null 2>&1 || die "$tool not found on PATH"
done
if [[ "$PEER_CUDA" == ON ]]; then
    command -v nvcc >/dev/null 2>&1 || die "nvcc not found on PATH nor in /usr/local/cuda*/bin"
    NVCC="$(command -v nvcc)"
    echo "   nvcc: $NVCC ($("$NVCC" --version | tail -1))"
    CUDA_FLAGS=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCH" -DCMAKE_CUDA_COMPILER="$NVCC" -DGGML_CUDA_NCCL=OFF)
    # cuBLAS: ggml-cuda links CUDA::cublas. A toolkit assembled from pip wheels may lack it while
    # python's nvidia-cublas wheel (nvidia/cu13/{lib,include}) has it; then name it to cmake.
    TOP="$("$NVCC" --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)"
    TOP="$(cd "${TOP:-/usr/local/cuda}" 2>/dev/null && pwd -P || echo /usr/local/cuda)"
    TK_LIB="" TK_INC="" RPATH_DIRS=()
    # the binaries find the toolkit's libcudart (and an outside cuBLAS) through their RUNPATH, in
    # case the loader's search path lacks those directories
    for d in "$TOP/lib64" "$TOP/lib" "$TOP/targets/x86_64-linux/lib"; do
        if compgen -G "$d/libcudart.so*" >/dev/null; then RPATH_DIRS+=("$(cd "$d" && pwd -P)"); break; fi
    done
    for d in "$TOP/lib64" "$TOP/lib" "$TOP/targets/x86_64-linux/lib"; do
        [[ -e "$d/libcublas.so" ]] && TK_LIB="$d/libcublas.so"
    done
    for d in "$TOP/include" "$TOP/targets/x86_64-linux/include"; do
        [[ -e "$d/cublas_v2.h" ]] && TK_INC="$d"
    done
    # the driver library (CUDA::cuda_driver, for ggml's VMM pool): the toolkit's stub, else the
    # installed driver's libcuda.so.1; with neither, build without VMM (GGML_CUDA_NO_VMM) and say so
    TK_DRV=""
    for d in "$TOP/lib64" "$TOP/lib" "$TOP/targets/x86_64-linux/lib"; do
        for f in "$d/stubs/libcuda.so" "$d/libcuda.so"; do [[ -e "$f" ]] && TK_DRV="$f"; done
    done
    if [[ -z "$TK_DRV" ]]; then
        DRV="$(ldconfig -p 2>/dev/null | sed -n 's/.*libcuda\.so\.1 .*=> //p' | head -1)"
        for f in /usr/lib/x86_64-linux-gnu/libcuda.so.1 /usr/lib64/libcuda.so.1 /usr/local/nvidia/lib64/libcuda.so.1 \
                 /usr/local/nvidia/lib/libcuda.so.1; do
            [[ -z "$DRV" && -e "$f" ]] && DRV="$f"
        done
        if [[ -n "$DRV" ]]; then
            CUDA_FLAGS+=(-DCUDA_cuda_driver_LIBRARY="$DRV")
            TK_DRV="$DRV (installed driver)"
        else
            CUDA_FLAGS+=(-DGGML_CUDA_NO_VMM=ON)
            TK_DRV="none: GGML_CUDA_NO_VMM=ON (legacy memory pool)"
        fi
    fi
    echo "   CUDA toolkit: $TOP (cublas: ${TK_LIB:-none}, cublas_v2.h: ${TK_INC:-none}, driver: $TK_DRV)"
    if [[ -z "$TK_LIB" || -z "$TK_INC" ]]; then
        PY="${PYTHON:-python3}"
        NV_DIRS="$("$PY" -c 'import nvidia; print("\n".join(nvidia.__path__))' 2>/dev/null || true)"
        CB_LIB="" CB_LT="" CB_INC=""
        MAJOR="$("$NVCC" --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p' | head -1)"
        if [[ -n "$NV_DIRS" ]]; then
            mapfile -t NV_ARR <<< "$NV_DIRS"
            for pat in "libcublas.so.$MAJOR*" 'libcublas.so*'; do  # prefer the toolkit's major version
                [[ -n "$CB_LIB" ]] || CB_LIB="$(find "${NV_ARR[@]}" -name "$pat" -type f 2>/dev/null | sort | head -1)"
            done
            if [[ -n "$CB_LIB" ]]; then
                CB_LT="$(find "$(dirname "$CB_LIB")" -maxdepth 1 -name 'libcublasLt.so*' -type f | sort | head -1)"
                [[ -e "$(dirname "$(dirname "$CB_LIB")")/include/cublas_v2.h" ]] \
                    && CB_INC="$(dirname "$(dirname "$CB_LIB")")/include/cublas_v2.h"
            fi
        fi
        if [[ -z "$CB_LIB" ]]; then
            CB_LIB="$(ldconfig -p 2>/dev/null | sed -n 's/.*libcublas\.so[.0-9]* .*=> //p' | head -1)"
            CB_LT="$(ldconfig -p 2>/dev/null | sed -n 's/.*libcublasLt\.so[.0-9]* .*=> //p' | head -1)"
        fi
        [[ -n "$CB_LIB" && -n "$CB_LT" ]] || die "no cuBLAS: not in $TOP, not in python's nvidia packages ($PY), not in ldconfig"
        [[ -n "$TK_INC" || -n "$CB_INC" ]] || die "no cublas_v2.h in $TOP nor in python's nvidia packages"
        echo "   cuBLAS from outside the toolkit: $CB_LIB, $CB_LT, ${CB_INC:-$TK_INC/cublas_v2.h}"
        CUDA_FLAGS+=(-DCUDA_cublas_LIBRARY="$CB_LIB" -DCUDA_cublasLt_LIBRARY="$CB_LT")
        RPATH_DIRS+=("$(dirname "$CB_LIB")")
        if [[ -z "$TK_INC" ]]; then
            CUDA_FLAGS+=(-DCMAKE_CUDA_FLAGS="-I$(dirname "$CB_INC")" -DCMAKE_CXX_FLAGS="-I$(dirname "$CB_INC")")
        fi
    fi
    if (( ${#RPATH_DIRS[@]} )); then
        CUDA_FLAGS+=(-DCMAKE_BUILD_RPATH="$(IFS=';'; echo "${RPATH_DIRS[*]}")")
        echo "   RUNPATH: ${RPATH_DIRS[*]}"
    fi
else
    echo "   PEER_CUDA=$PEER_CUDA: building for the CPU (a test of this script, not a peer build)"
    CUDA_FLAGS=(-DGGML_CUDA=OFF)
fi
echo "   cmake: $(cmake --version | head -1); ninja $(ninja --version); $(nproc) CPUs; JOBS=$JOBS"
[[ -f "$TARBALL" ]] || die "$TARBALL not found: run evals/peer/fetch_source.sh here and carry .peer/llama.cpp.tar.xz"
TAR_SHA="$(sha256sum "$TARBALL" | cut -d' ' -f1)"
STAMP="tarball=$TAR_SHA targets=${TARGETS[*]} cuda=$PEER_CUDA arch=$CUDA_ARCH cmake=${PEER_CMAKE_ARGS:-}"
step_done "tools"

have_bins() {  # the binaries in .peer/bin were built from this tarball for these targets
    [[ -f "$BIN_DIR/stamp" && "$(cat "$BIN_DIR/stamp")" == "$STAMP" ]] || return 1
    local t
    for t in "${TARGETS[@]}"; do [[ -x "$BIN_DIR/$t" ]] || return 1; done
}
if (( ! FORCE )) && have_bins; then
    echo "== [build.sh] $BIN_DIR already holds ${TARGETS[*]} built from this tarball: skipping the build (--force rebuilds)"
else
    # 1. extract
    step "extracting $TARBALL to $SRC"
    rm -rf "$SRC"
    mkdir -p "$SRC"
    tar -xJf "$TARBALL" -C "$SRC" --strip-components=1
    [[ -f "$SRC/PEER_VERSION" ]] || die "the tarball has no PEER_VERSION"
    cat "$SRC/PEER_VERSION"
    COMMIT="$(sed -n 's/^llama_cpp_commit=//p' "$SRC/PEER_VERSION")"
    step_done "extract"

    # 2. configure
    step "configuring (CUDA=$PEER_CUDA, sm_$CUDA_ARCH) in $BUILD"
    rm -rf "$BUILD"
    SERVER_FLAG=OFF
    (( SERVER )) && SERVER_FLAG=ON
    # GIT_CEILING_DIRECTORIES: the build-info steps run git in the source tree; never let them find a
    # repository above it (the commit comes from PEER_VERSION instead)
    if ! GIT_CEILING_DIRECTORIES="$(dirname "$SRC")" cmake -S "$SRC" -B "$BUILD" -G Ninja \
            -DCMAKE_BUILD_TYPE=Release \
            "${CUDA_FLAGS[@]}" -DGGML_CCACHE=OFF \
            -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
            -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
            -DLLAMA_BUILD_SERVER="$SERVER_FLAG" -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
            -DLLAMA_BUILD_COMMIT="${COMMIT:0:9}" ${PEER_CMAKE_ARGS:-} > "$BUILD.configure.log" 2>&1; then
        tail -60 "$BUILD.configure.log" >&2
        save_log "$BUILD.configure.log"
        die "cmake configure failed (log: $BUILD.configure.log)"
    fi
    grep -E "CUDA Toolkit found|Using CUDA architectures|CMAKE_CUDA_ARCHITECTURES|ggml version|Adding CPU backend" \
        "$BUILD.configure.log" || true
    step_done "configure"

    # 3. build
    step "ninja -j$JOBS ${TARGETS[*]}"
    if ! ninja -C "$BUILD" -j"$JOBS" "${TARGETS[@]}" > "$BUILD.build.log" 2>&1; then
        grep -n -E "error|Error" "$BUILD.build.log" | head -40 >&2 || true
        tail -60 "$BUILD.build.log" >&2
        save_log "$BUILD.build.log"
        die "ninja failed (log: $BUILD.build.log)"
    fi
    tail -1 "$BUILD.build.log"
    step_done "build"

    # 4. install into .peer/bin
    step "stripping into $BIN_DIR"
    mkdir -p "$BIN_DIR"
    rm -f "$BIN_DIR/stamp"
    for t in "${TARGETS[@]}"; do
        strip -o "$BIN_DIR/$t.tmp" "$BUILD/bin/$t"
        chmod +x "$BIN_DIR/$t.tmp"
        mv "$BIN_DIR/$t.tmp" "$BIN_DIR/$t"
        ls -la "$BIN_DIR/$t"
    done
    cp "$SRC/PEER_VERSION" "$BIN_DIR/PEER_VERSION"
    echo "$STAMP" > "$BIN_DIR/stamp"
    step_done "install"
fi

# 5. checks: every library resolves, and llama-bench sees the GPU
step "checking the binaries"
for t in "${TARGETS[@]}"; do
    LDD="$(ldd "$BIN_DIR/$t" 2>&1 || true)"
    if grep -q "not found" <<< "$LDD"; then
        echo "$LDD" >&2
        die "$t has unresolved libraries"
    fi
done
grep -E "cuda|cublas" <<< "$(ldd "$BIN_DIR/llama-bench" 2>&1 || true)" || true
DEVICES="$("$BIN_DIR/llama-bench" --list-devices 2>&1)" || { echo "$DEVICES" >&2; die "llama-bench --list-devices failed"; }
echo "$DEVICES"
if [[ "$PEER_CUDA" == ON ]]; then
    echo "$DEVICES" | grep -q "CUDA0" || die "llama-bench lists no CUDA device"
fi
step_done "checks"

# 6. export compressed pieces (what comes back from $OUT: at most 8 files, 64 MiB together)
if (( EXPORT )); then
    [[ -n "${OUT:-}" && -d "${OUT:-}" ]] || die "--export needs \$OUT set to an existing directory"
    step "exporting xz pieces of ${EXPORT_ONLY:-${TARGETS[*]/llama-quantize/}} to $OUT"
    BUDGET=$(( ${EXPORT_BUDGET_MIB:-60} * 1048576 ))
    USED=0
    N_FILES=1  # peer-bin.sha256
    : > "$OUT/peer-bin.sha256"
    # shellcheck disable=SC2206
    EXPORTS=(${EXPORT_ONLY:-${TARGETS[*]/llama-quantize/}})
    for t in "${EXPORTS[@]}"; do  # in order: llama-bench first
        [[ -x "$BIN_DIR/$t" ]] || die "EXPORT_ONLY names $t, which this build did not make"
        XZ="$(mktemp)"
        xz -T"$JOBS" -6 -c "$BIN_DIR/$t" > "$XZ"
        SIZE=$(stat -c %s "$XZ")
        PIECES=$(( (SIZE + 15 * 1048576 - 1) / (15 * 1048576) ))
        if (( USED + SIZE > BUDGET || N_FILES + PIECES > 8 )); then
            echo "build.sh: WARNING: $t not exported: $(( SIZE >> 20 )) MiB compressed would pass what comes back" \
                 "(${EXPORT_BUDGET_MIB:-60} MiB, 8 files); it stays in $BIN_DIR on this machine" >&2
            rm -f "$XZ"
            continue
        fi
        split -b 15M -d -a 2 "$XZ" "$OUT/$t.xz.part-"
        rm -f "$XZ"
        (cd "$BIN_DIR" && sha256sum "$t") >> "$OUT/peer-bin.sha256"
        USED=$(( USED + SIZE ))
        N_FILES=$(( N_FILES + PIECES ))
    done
    ls -la "$OUT"
    step_done "export"
fi

echo "== [build.sh] done in $(awk -v a="$T_START" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s: $BIN_DIR/${TARGETS[*]}"
