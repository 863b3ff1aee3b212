#!/usr/bin/env bash
# GPU-machine runs for issue 26 (quantized experts), one PART per device call (each under 10 min).
#   PART=next   the packed CPU kernels and their native tests on a quiet machine, then the
#               packed GPU tests and the packed grouped GEMM probe while llama-bench builds, then the GGUF
#               (a warm machine ready for PART=sbs)
#   PART=cpu    the packed CPU kernels alone (bench cpu-experts), optionally beside OLD_TREE's (an earlier commit)
#   PART=prep   llama-bench, llama-quantize and llama-server built while the Q8_0 source is written and the
#               native / packed GPU tests run; then llama-quantize (QUANTIZER=llama's file)
#   PART=sbs    side by side on one Q4_K_M GGUF (evals/peer/write_gguf.py --quant q4_k_m):
#               llama-bench at each -ncmoe of NCMOE (decode, PROMPTS prefill), then ours at each cap
#               of CAPS (bench decode / bench prefill on the same file, 8 threads), and llama.cpp's
#               CPU MoE path (-ncmoe all) next to ours with every expert on the CPU.
# QUANTIZER=llama (PART=prep / sbs; default: write_gguf.py writes the Q4_K_M blocks directly): the GGUF is
#               made by llama.cpp's llama-quantize instead (evals/peer/requantize.sh: a Q8_0 source of the
#               same shape, requantized with --allow-requantize, then deleted); build.sh gets --quantize
#               (PART=sbs builds when .peer/bin has no llama-quantize: restore.sh does not bring it).
#               Both files are on the disk at once for a while (48 layers, --plan: Q8_0 30.25 GiB + Q4_K_M
#               17.28 GiB). On the H100 machine (2026-12-07) the Q8_0 source took 59.6 s and llama-quantize
#               had not finished after 200 s on 16 threads (killed): give it a call of its own (PART=prep
#               leaves the source for it when the build eats the call). GGUF_S (seconds, default 240) bounds
#               PART=sbs's GGUF step.
# Carry [".whl" (evals/gpu/device_wheels.sh makes it), ".peer/llama.cpp.tar.xz"] (+ ".peer/export" once a build's pieces came back).
# Everything lands in $OUT: results.tar.gz (logs and JSON, packed after every step); a summary is printed last.
set -u
export OUT=${OUT:-/tmp/issue26}
R=/tmp/issue26-results
mkdir -p "$OUT" "$R"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
# the cache (calibration, and the demo models the tests write) stays out of $R: packing it after every step
# took tens of seconds and made results.tar.gz too big to come back; the calibration is copied into $R
export FREETOKEN_CACHE_DIR=/tmp/issue26-cache
F="python3 -m freetoken_agent"
t0=$(date +%s)
export QUANTIZER=${QUANTIZER:-}  # read by gguf_q4km, also in the bash -c below
QZ_FLAG=$([ "${QUANTIZER:-}" = llama ] && echo --quantize)
gguf_q4km() {  # gguf_q4km OUT THREADS [WRITE_GGUF_ARGS...]: the side by side's Q4_K_M file, per QUANTIZER
    local out=$1 th=$2; shift 2
    if [ "${QUANTIZER:-}" = llama ]; then
        bash evals/peer/requantize.sh --out "$out" --type Q4_K_M --threads "$th" -- "$@" --seed 0 --threads "$th"
    else
        python3 evals/peer/write_gguf.py "$@" --quant q4_k_m --seed 0 --threads "$th" --out "$out"
    fi
}
pack() { find "$FREETOKEN_CACHE_DIR" -maxdepth 2 -name "calibration*.json" -exec cp {} "$R/" \; 2>/dev/null; tar -czf "$OUT/results.tar.gz" -C "$R" . 2>/dev/null; }
at() { echo "[$(( $(date +%s) - t0 )) s] $*"; pack; }  # results packed after every step: a killed call keeps them
left() { echo $(( ${BUDGET_S:-560} - ($(date +%s) - t0) )); }  # seconds this call has left
trap pack EXIT
lscpu | grep -E "Model name|^CPU\(s\)|Flags" | sed 's/Flags:.*\(avx512[a-z_0-9]*\).*/Flags: has avx512 (\1 ...)/' > "$R/cpu.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$R/cpu.txt"
cat "$R/cpu.txt"
python3 native/build.py -j 16 > "$R/native_build.log" 2>&1 || { at "native build failed"; tail -5 "$R/native_build.log"; }
at "native built"
case "${PART:-next}" in
next)
    # quiet machine first: the native tests, the packed CPU kernels (bench cpu-experts) and the layer call's
    # chunk / prefetch / batch probe; then while llama.cpp's llama-bench builds: the packed GPU tests and the
    # packed grouped GEMM's probe; the GGUF last. PART=sbs on the warm machine next.
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/native/test_moe_packed.py tests/native/test_kernels.py \
        tests/native/test_executor.py > "$R/native_tests.log" 2>&1
    at "native tests (quiet): exit $? ($(tail -1 "$R/native_tests.log"))"
    for f in ${CPU_FORMATS:-q4_k q6_k q8_0}; do
        timeout 90 $F bench cpu-experts --format "$f" --threads ${CPU_THREADS:-1,6,8,16} --seconds 0.5 --rounds 2 --bank-gb 2 --no-torch \
            --isa "${CPU_ISA:-auto}" --json > "$R/cpu_$f.json" 2> "$R/cpu_$f.err"
        at "cpu-experts $f: exit $?"
    done
    timeout 120 python3 -m evals.native.chunk_probe --formats q4_k,q8_0 --threads 8,16 > "$R/chunk_probe.txt" 2>&1
    at "chunk probe: exit $?"
    rm -f "$R/peer_build.rc"
    (bash evals/peer/build.sh > "$R/peer_build.log" 2>&1; echo $? > "$R/peer_build.rc") &
    build=$!
    timeout 120 python3 -m evals.gpu.packed_grouped_probe > "$R/grouped_probe.jsonl" 2> "$R/grouped_probe.err"
    at "packed grouped probe: exit $? ($(tail -1 "$R/grouped_probe.err"))"
    timeout "${TEST_S:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/gpu_quant \
        > "$R/gpu_tests.log" 2>&1
    at "gpu tests: exit $? ($(tail -1 "$R/gpu_tests.log"))"
    mkdir -p /tmp/peer
    timeout 120 python3 evals/peer/write_gguf.py --layers 48 --quant q4_k_m --seed 0 --threads 8 --out /tmp/peer/q4km.gguf \
        > "$R/gguf.log" 2>&1
    at "gguf: exit $? $(du -h /tmp/peer/q4km.gguf 2>/dev/null | cut -f1)"
    wait $build
    at "llama.cpp build: exit $(cat "$R/peer_build.rc")"
    ;;
cpu)
    # the packed CPU kernels alone on a quiet machine (bench cpu-experts, FORMATS x CPU_THREADS), ROUNDS times;
    # with OLD_TREE (a folder holding an earlier commit's native/: git archive COMMIT native | tar -x -C DIR)
    # that tree's kernels run beside them in alternation, from a process whose first path entry is OLD_TREE
    # (files cpu_FORMAT_{old,new}_ROUND.json)
    trees=new
    if [ -n "${OLD_TREE:-}" ]; then
        OLD_TREE=$(cd "$OLD_TREE" && pwd)
        (cd "$OLD_TREE" && python3 native/build.py -j 16 > "$R/native_build_old.log" 2>&1) && trees="old new"
        at "old tree's native build: $(tail -1 "$R/native_build_old.log")"
    fi
    for round in $(seq 1 "${ROUNDS:-2}"); do
        for f in ${CPU_FORMATS:-q4_k q6_k q8_0}; do
            for tree in $trees; do
                dir=$([ "$tree" = old ] && echo "$OLD_TREE" || echo "$PWD")
                (cd "$dir" && python3 -c "import native; print('$tree:', native.__file__)" >> "$R/cpu_trees.txt" 2>&1
                 timeout 90 $F bench cpu-experts --format "$f" --threads "${CPU_THREADS:-1,8,16}" --seconds 0.5 --rounds 2 \
                    --bank-gb 2 --no-torch --json > "$R/cpu_${f}_${tree}_$round.json" 2> "$R/cpu_${f}_${tree}_$round.err")
                at "cpu-experts $f $tree round $round: exit $?"
            done
        done
    done
    ;;
prep)
    # a warm machine ready for PART=sbs (QUANTIZER=llama) and run_replay.sh: llama.cpp's llama-bench,
    # llama-quantize and llama-server built in the background while the Q8_0 source is written (requantize.sh
    # reuses it: write_gguf.py's stamp) and the native and packed GPU tests run (correctness only: the
    # machine is busy, so nothing is timed here); then llama-quantize makes the side by side's Q4_K_M file
    rm -f "$R/peer_build.rc"
    (bash evals/peer/build.sh --quantize --server > "$R/peer_build.log" 2>&1; echo $? > "$R/peer_build.rc") &
    build=$!
    GGUF=/tmp/peer/q4km.gguf
    mkdir -p /tmp/peer
    (timeout 300 python3 evals/peer/write_gguf.py --quant q8_0 --out "$GGUF.q8_0.gguf" --layers 48 --seed 0 \
        --threads "$(nproc)" > "$R/gguf_src.log" 2>&1; echo $? > "$R/gguf_src.rc") &
    src=$!
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/native/test_moe_packed.py tests/native/test_kernels.py \
        tests/native/test_executor.py > "$R/native_tests.log" 2>&1
    at "native tests: exit $? ($(tail -1 "$R/native_tests.log"))"
    timeout "${TEST_S:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/gpu_quant \
        > "$R/gpu_tests.log" 2>&1
    at "gpu tests: exit $? ($(tail -1 "$R/gpu_tests.log"))"
    wait $src
    at "q8_0 source: exit $(cat "$R/gguf_src.rc") $(du -h "$GGUF.q8_0.gguf" 2>/dev/null | cut -f1)"
    wait $build
    at "llama.cpp build: exit $(cat "$R/peer_build.rc") ($(grep -h 'build.sh\] build' "$R/peer_build.log" | tail -1))"
    [ "$(left)" -gt 30 ] && timeout $(( $(left) - 10 )) bash -c "$(declare -f gguf_q4km); gguf_q4km $GGUF $(nproc) --layers 48" \
        > "$R/gguf.log" 2>&1
    at "gguf (llama-quantize): exit $? $(du -h "$GGUF" 2>/dev/null | cut -f1)"
    ;;
sbs)
    [ -x .peer/bin/llama-bench ] || bash evals/peer/restore.sh .peer/export || exit 1
    if [ -n "$QZ_FLAG" ] && [ ! -x .peer/bin/llama-quantize ]; then
        bash evals/peer/build.sh --quantize > "$R/peer_build.log" 2>&1 || { tail -5 "$R/peer_build.log"; exit 1; }
        at "llama.cpp build with llama-quantize"
    fi
    GGUF=/tmp/peer/q4km.gguf
    # shellcheck disable=SC2086
    [ -f "$GGUF" ] || timeout "${GGUF_S:-240}" bash -c "$(declare -f gguf_q4km); gguf_q4km $GGUF $(nproc) ${GGUF_ARGS:---layers 48}" \
        > "$R/gguf.log" 2>&1 || { tail -5 "$R/gguf.log"; exit 1; }
    at "gguf: $(du -h "$GGUF" | cut -f1)"
    python3 evals/peer/run_bench.py --model "$GGUF" --ncmoe "${NCMOE:-48,34,23,11}" --threads 8 \
        --prompts "${PROMPTS:-16384}" --gen 128 --ubatch 2048 --reps "${REPS:-2}" --load-mode none \
        --timeout "${PEER_S:-120}" --out-dir "$R" | tail -8
    at "peer done"
    $F calibrate --shape qwen3-30b-a3b --threads 8 --json > "$R/calibration.json" 2> "$R/calibration.err"
    for cap in ${CAPS:-8GiB 12GiB 16GiB}; do
        [ "$(left)" -gt 60 ] || break
        timeout "${DEC_S:-150}" $F bench decode --model "$GGUF" --temperature 1000 --gpu-memory "$cap" \
            --cpu-threads 8 --tokens 128 --reps 3 --json > "$R/dec_ours_$cap.json" 2> "$R/dec_ours_$cap.err"
        at "decode $cap: exit $?"
        [ "${PROMPTS:-16384}" = 0 ] && continue
        case " ${PREFILL_CAPS:-12GiB} " in *" $cap "*) ;; *) continue ;; esac
        [ "$(left)" -gt 60 ] || break
        timeout "${PRE_S:-120}" $F bench prefill --model "$GGUF" --gpu-memory "$cap" --cpu-threads 8 \
            --prompt-tokens "${PROMPTS:-16384}" --chunk 8192 --json > "$R/pre_ours_$cap.json" 2> "$R/pre_ours_$cap.err"
        at "prefill $cap: exit $?"
    done
    # every expert on the CPU (llama.cpp's -ncmoe 48 next to it): dense on the GPU, experts on moe_packed
    [ "$(left)" -gt 60 ] && timeout "${DEC_S:-150}" $F bench decode --model "$GGUF" --temperature 1000 --gpu-memory off \
        --cpu-threads 8 --tokens 64 --reps 2 --json > "$R/dec_ours_cpu.json" 2> "$R/dec_ours_cpu.err"
    at "decode, experts on the CPU: exit $?"
    ;;
esac
python3 evals/gpu/summary.py "$R" 2>/dev/null | tail -30
python3 -m evals.gpu.quant_summary "$R"
at "done"
