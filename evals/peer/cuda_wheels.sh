#!/usr/bin/env bash
# cuda_wheels.sh - assemble a CUDA toolkit (nvcc, headers, cudart, cuBLAS) from NVIDIA's PyPI wheels, so the
# CUDA peer can be built on a machine with no GPU and no toolkit (this development machine) and carried to the
# GPU machine as pieces, instead of spending ~6 minutes of device time on its build there.
#
# Contract: bash evals/peer/cuda_wheels.sh DIR
#   - downloads (pip download --no-deps) nvidia-cuda-nvcc, -runtime, -cccl, -crt, nvidia-nvvm and nvidia-cublas
#     of CUDA $CUDA_WHEELS (default 13.0: the GPU machine's toolkit and driver) into DIR/wheels, unpacks them
#     into DIR/site, and adds the links a toolkit layout has (lib64, targets/x86_64-linux/{include,lib,lib64},
#     the unversioned libcudart / libcublas / libcublasLt);
#   - prints the toolkit's bin folder last. Then, for example (the GPU host's CPU named, not this one's):
#       PATH=$(tail -1 of that):$PATH PEER_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON
#         -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON" JOBS=2 \
#         OUT=/tmp/pieces bash evals/peer/build.sh --server --export
#     (build.sh's last check, that llama-bench sees a CUDA device, fails here after the binaries are in
#     .peer/bin; export them with `EXPORT_ONLY=... build.sh --export` once more, or as build.sh does by hand).
#     On the GPU machine evals/peer/restore.sh reassembles them and, since their RUNPATH names this machine's
#     DIR, points them at the CUDA libraries found there (python's nvidia wheels under torch).
# Built this way there is no libcuda: build.sh then sets GGML_CUDA_NO_VMM (ggml's legacy CUDA memory pool),
# a difference from a build on the GPU machine to state beside any number such a binary gives.
set -euo pipefail
DIR="${1:?usage: cuda_wheels.sh DIR}"
VER="${CUDA_WHEELS:-13.0}"
MAJOR="${VER%%.*}"
mkdir -p "$DIR/wheels" "$DIR/site"
DIR="$(cd "$DIR" && pwd)"
"${PYTHON:-python3}" -m pip download -q --no-deps --dest "$DIR/wheels" \
    "nvidia-cuda-nvcc==$VER.*" "nvidia-cuda-runtime==$VER.*" "nvidia-cuda-cccl==$VER.*" \
    "nvidia-cuda-crt==$VER.*" "nvidia-nvvm==$VER.*" "nvidia-cublas==$VER.*"
for w in "$DIR"/wheels/*.whl; do
    "${PYTHON:-python3}" -m zipfile -e "$w" "$DIR/site"
done
T="$DIR/site/nvidia/cu$MAJOR"
[[ -d "$T/bin" && -d "$T/include" && -d "$T/lib" ]] || { echo "cuda_wheels.sh: no toolkit layout in $T" >&2; exit 1; }
ln -sfn lib "$T/lib64"
mkdir -p "$T/targets/x86_64-linux"
for d in include lib lib64; do
    ln -sfn "../../$([ "$d" = include ] && echo include || echo lib)" "$T/targets/x86_64-linux/$d"
done
for l in cudart cublas cublasLt; do
    [[ -e "$T/lib/lib$l.so" ]] || ln -s "lib$l.so.$MAJOR" "$T/lib/lib$l.so"
done
chmod +x "$T"/bin/* "$T"/nvvm/bin/* 2>/dev/null || true  # zipfile keeps no modes
"$T/bin/nvcc" --version | tail -1 >&2
echo "$T/bin"
