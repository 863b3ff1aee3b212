#!/usr/bin/env bash
# One GPU-machine run for the GPU tier (issue 6): the GPU tests, the calibration, and the decode /
# prefill benchmarks on dummy weights of real shapes; JSON and logs land in $OUT, a table is
# printed last. Run from the repository root with the wheels installed (see docs/benchmarks.md).
set -u
OUT=${OUT:-/tmp/issue6}
mkdir -p "$OUT"
F="python3 -m freetoken_agent"
python3 native/build.py -j 16 >/dev/null 2>&1 || echo "native build failed"
timeout "${TEST_S:-90}" python3 -m pytest -q -p no:cacheprovider tests/engine/gpu_cache/test_device_step_cuda.py \
    tests/engine/gpu_cache/test_prefill_stream_cuda.py tests/engine/gpu_cache/test_gpu_memory_cuda.py \
    tests/engine/test_decode_graph.py 2>&1 | grep -v "^\[W" > "$OUT/gpu_tests.log"
tail -3 "$OUT/gpu_tests.log"
$F calibrate --shape qwen3-30b-a3b --threads 8 --json > "$OUT/calibration.json" 2>/dev/null
bench() {
    local name=$1 limit=$2; shift 2
    timeout "$limit" $F bench "$@" --dummy --cpu-threads 8 --json > "$OUT/$name.json" 2> "$OUT/$name.err"
    echo "$name: exit $?"
}
bench dec_q3_24L_12G 90 decode --shape qwen3-30b-a3b --layers 24 --gpu-memory 12GiB --tokens 128 --reps 3
bench pre_q3_24L_12G 90 prefill --shape qwen3-30b-a3b --layers 24 --gpu-memory 12GiB --prompt-tokens 1024,4096,16384 --chunk 8192
bench dec_q36_24G 110 decode --shape qwen3.6-35b-a3b --gpu-memory 24GiB --tokens 128 --reps 3
python3 -m evals.gpu.summary "$OUT"
