#!/usr/bin/env bash
# One GPU-machine run for the GPU tier (issue 6): the GPU tests (TESTS=quick / all; names and failures in
# $OUT/gpu_tests.log, one pytest per path), the calibration, and the decode / prefill benchmarks on dummy weights
# of both shapes at a 12 GiB and a 16 GiB cap, the torch plan, the torch Gated DeltaNet step, the opt-in shared-expert
# kernel, whole experts and the static ratio (split expert off) and a second fetch ratio against the defaults; JSON
# and logs land in $OUT, a table is printed last.
# Run from the repository root with the wheels installed (see docs/benchmarks.md). TEST_S bounds
# the tests (default 300 s); BENCH=0 skips the benchmarks, ONLY=regex picks them by name. The
# side-by-side run with llama.cpp is evals/gpu/run_side_by_side.sh.
set -u
OUT=${OUT:-/tmp/issue6}
mkdir -p "$OUT"
F="python3 -m freetoken_agent"
python3 native/build.py -j 16 >/dev/null 2>&1 || echo "native build failed"
# explicit paths: collecting the whole tests/ tree imports client SDKs the GPU machine lacks.
# TESTS=quick (default): what changed since the last GPU run, the engine-level equalities and one
# capped engine per family (~3 min); TESTS=all: every GPU test of the engine (~15 min; all1 / all2:
# its halves, one device call each); TESTS=none;
# or TESTS="path path ...".
QUICK=(tests/engine/gpu_cache/test_step_kernels.py tests/engine/gpu_cache/test_slot_kernels.py
       tests/engine/test_host_embedding.py tests/engine/test_fused_shared.py tests/engine/test_fused_gdn.py
       tests/engine/test_fused_ops.py
       tests/engine/test_decode_attention.py tests/engine/test_graph_cache.py tests/engine/gpu_cache/test_plan_kernel.py
       tests/engine/gpu_cache/test_device_step_cuda.py
       tests/engine/gpu_cache/test_grouped_experts.py tests/engine/test_gguf_model.py
       "tests/engine/gpu_cache/test_gpu_memory_cuda.py::test_capped_engine_equals_uncapped[0.5-qwen3_moe]"
       "tests/engine/gpu_cache/test_gpu_memory_cuda.py::test_capped_engine_equals_uncapped[0.5-qwen3_5_moe]"
       tests/engine/gpu_cache/test_gpu_memory_cuda.py::test_whole_expert_engine_equals_uncapped
       tests/engine/gpu_cache/test_gpu_memory_cuda.py::test_short_prompts_run_as_captured_decode_passes_under_a_cap
       tests/engine/gpu_cache/test_gpu_memory_cuda.py::test_concurrent_decode_batches_are_captured_under_a_cap
       tests/engine/gpu_cache/test_gpu_memory_cuda.py::test_overlapped_decode_equals_serial_under_a_cap
       tests/engine/gpu_cache/test_gpu_memory_cuda.py::test_concurrent_sampled_requests_finish_under_a_cap
       tests/engine/test_decode_staging.py tests/engine/gpu_cache/test_load_guard.py
       tests/engine/gpu_cache/test_prefill_stream_cuda.py tests/engine/test_gpu.py tests/evals/test_kernel_profile.py)
# TESTS=all is ~15 min on the H200 (tenth session's files took ~11): more than one device call, so
# all1 and all2 split it into halves of ~8 and ~7 min, one per call
ALL1=(tests/engine/test_decode_attention.py tests/engine/test_graph_cache.py tests/engine/test_decode_graph.py
      tests/engine/gpu_cache/test_device_step_cuda.py tests/engine/gpu_cache/test_gpu_memory_cuda.py
      tests/engine/gpu_cache/test_elastic.py tests/engine/gpu_cache/test_load_guard.py
      tests/engine/test_decode_staging.py tests/native/test_host_task.py tests/engine/test_gguf_model.py)
ALL2=(tests/engine/gpu_cache/test_plan_kernel.py tests/engine/gpu_cache/test_prefill_stream_cuda.py
      tests/engine/gpu_cache/test_gpu_cache_cuda.py tests/engine/gpu_cache/test_grouped_experts.py
      tests/engine/gpu_cache/test_step_kernels.py tests/engine/gpu_cache/test_slot_kernels.py
      tests/engine/test_gpu.py tests/freetoken_agent/test_gpu_memory_default.py tests/engine/test_fused_gdn.py
      tests/engine/test_fused_ops.py tests/engine/test_fused_shared.py tests/engine/test_host_embedding.py
      tests/evals/test_kernel_profile.py)
case "${TESTS:-quick}" in
    all) SEL=("${ALL1[@]}" "${ALL2[@]}") ;;
    all1) SEL=("${ALL1[@]}") ;;
    all2) SEL=("${ALL2[@]}") ;;
    quick) SEL=("${QUICK[@]}") ;;
    none) SEL=() ;;
    *) read -r -a SEL <<< "$TESTS" ;;  # a list of test paths
esac
# one pytest per path: a crash (an illegal address aborts the process) loses one file's report,
# not the run's; the Triton-interpreter tests are left to the CPU machine (slow here)
: > "$OUT/gpu_tests.log"
end=$(( $(date +%s) + ${TEST_S:-300} ))
# a test that hangs (a GPU wait nothing answers) ends its file with every thread's stack in the log,
# where pytest-timeout is installed (the GPU machine's image has it)
PER_TEST=()
python3 -c "import pytest_timeout" 2>/dev/null && PER_TEST=(--timeout "${TEST_TIMEOUT_S:-240}" --timeout-method=thread)
for t in "${SEL[@]+"${SEL[@]}"}"; do
    left=$(( end - $(date +%s) ))
    [ "$left" -gt 5 ] || { echo "$t: not run (TEST_S)" | tee -a "$OUT/gpu_tests.log"; continue; }
    timeout "$left" python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -k "not interpreter" ${PER_TEST[@]+"${PER_TEST[@]}"} "$t" 2>&1 \
        | grep -v "^\[W" > "$OUT/t.log"
    { echo "== $t"; grep -E "^(FAILED|ERROR|E  )|passed|failed|Fatal|Aborted|Timeout|, in test_" "$OUT/t.log" | tail -12; } \
        | tee -a "$OUT/gpu_tests.log"
done
[ "${BENCH:-1}" = 0 ] && exit 0
$F calibrate --shape qwen3-30b-a3b --threads 8 --json > "$OUT/calibration.json" 2>/dev/null
$F calibrate --shape qwen3.6-35b-a3b --threads 8 --json > "$OUT/calibration_q36.json" 2>/dev/null
bench() {  # FREETOKEN_PLAN=torch bench ... passes the knob through the environment
    local name=$1 limit=$2; shift 2
    [[ "$name" =~ ${ONLY:-.} ]] || return 0
    timeout "$limit" $F bench "$@" --dummy --cpu-threads 8 --json > "$OUT/$name.json" 2> "$OUT/$name.err"
    echo "$name: exit $?"
}
bench dec_q3_24L_12G 90 decode --shape qwen3-30b-a3b --layers 24 --gpu-memory 12GiB --tokens 128 --reps 3
# a larger share of the misses over PCIe than the calibrated ratio: the CPU branch starts later
bench dec_q3_24L_12G_r055 90 decode --shape qwen3-30b-a3b --layers 24 --gpu-memory 12GiB --tokens 128 --reps 3 \
    --fetch-ratio 0.55
# the torch cache plan (engine/gpu/plan.py) against the default one-program plan, same shape and cap
FREETOKEN_PLAN=torch bench dec_q3_24L_12G_torchplan 90 decode --shape qwen3-30b-a3b --layers 24 --gpu-memory 12GiB \
    --tokens 128 --reps 3
bench dec_q36_20L_12G 120 decode --shape qwen3.6-35b-a3b --layers 20 --gpu-memory 12GiB --tokens 128 --reps 3
# the Gated DeltaNet step and the router as torch ops (FREETOKEN_FUSED_GDN / _ROUTER=0) against their
# Triton kernels (default since the fifth session)
FREETOKEN_FUSED_GDN=0 FREETOKEN_FUSED_ROUTER=0 bench dec_q36_20L_12G_torchgdn 120 decode --shape qwen3.6-35b-a3b \
    --layers 20 --gpu-memory 12GiB --tokens 128 --reps 3
# the token embedding on the GPU (FREETOKEN_HOST_EMBED=0) against the default page-locked host table
FREETOKEN_HOST_EMBED=0 bench dec_q36_20L_12G_devembed 120 decode --shape qwen3.6-35b-a3b --layers 20 --gpu-memory 12GiB \
    --tokens 128 --reps 3
# opt-in until measured: the shared expert's gate, product and sum as one kernel (engine/model/fused_ops.py)
FREETOKEN_FUSED_SHARED=1 bench dec_q36_20L_12G_fshared 120 decode --shape qwen3.6-35b-a3b --layers 20 --gpu-memory 12GiB \
    --tokens 128 --reps 3
# sampled decode (temperature 1: the draw stays on the device) against the greedy row above
bench dec_q36_20L_12G_t1 120 decode --shape qwen3.6-35b-a3b --layers 20 --gpu-memory 12GiB --tokens 128 --reps 3 \
    --temperature 1
# whole experts only (FREETOKEN_SPLIT_EXPERT=0, the default before the tenth session) against the
# default split expert with its online ratio; and the split with the static ratio (FREETOKEN_ADAPT_RATIO=0)
for cap in 12 16; do
    FREETOKEN_SPLIT_EXPERT=0 bench dec_q3_24L_${cap}G_whole 90 decode --shape qwen3-30b-a3b --layers 24 \
        --gpu-memory ${cap}GiB --tokens 128 --reps 3
    FREETOKEN_SPLIT_EXPERT=0 bench dec_q36_20L_${cap}G_whole 120 decode --shape qwen3.6-35b-a3b --layers 20 \
        --gpu-memory ${cap}GiB --tokens 128 --reps 3
done
FREETOKEN_ADAPT_RATIO=0 bench dec_q3_24L_16G_static 90 decode --shape qwen3-30b-a3b --layers 24 --gpu-memory 16GiB \
    --tokens 128 --reps 3
bench dec_q3_24L_16G 90 decode --shape qwen3-30b-a3b --layers 24 --gpu-memory 16GiB --tokens 128 --reps 3
bench dec_q36_20L_16G 120 decode --shape qwen3.6-35b-a3b --layers 20 --gpu-memory 16GiB --tokens 128 --reps 3
bench pre_q3_24L_12G 90 prefill --shape qwen3-30b-a3b --layers 24 --gpu-memory 12GiB --prompt-tokens 1024,8192,16384 --chunk 8192
# the expert cache as the previous request left it (what a serving engine has; llama.cpp's resident
# layers are always there): the kept experts are read in place
bench pre_q3_24L_12G_warm 90 prefill --shape qwen3-30b-a3b --layers 24 --gpu-memory 12GiB --prompt-tokens 1024,8192,16384 \
    --chunk 8192 --expert-cache warm
bench pre_q36_20L_12G 100 prefill --shape qwen3.6-35b-a3b --layers 20 --gpu-memory 12GiB --prompt-tokens 1024,8192,16384 \
    --chunk 8192
# kernel by kernel: where a decode token's time goes (the routed experts run, and skipped)
for z in "" "--zero-experts"; do
    name=kprof_q3_24L_12G${z:+_dense}
    [[ "$name" =~ ${ONLY:-.} ]] || continue
    timeout 120 python3 -m evals.gpu.kernel_profile --shape qwen3-30b-a3b --layers 24 --dummy --gpu-memory 12GiB \
        --cpu-threads 8 --tokens 32 --top 25 $z --out "$OUT/$name.kprof" > "$OUT/$name.txt" 2>&1
    echo "$name: exit $?"; tail -28 "$OUT/$name.txt"
done
python3 -m evals.gpu.summary "$OUT"
