#!/usr/bin/env bash
# Side by side with llama.cpp on one family's GGUF per device call (each under ~9 minutes):
#   PART=gptoss  gpt-oss-120b's shape as released (write_gguf.py --arch gpt-oss: MXFP4 experts, Q8_0
#                attention), as many of its 36 layers as the disk holds (the full file is 59 GiB:
#                --max-gib = free space less DISK_MARGIN_GIB, even layers), decode at the full model's
#                12 and 24 GiB cards (CAPS), scaled to the file's layers so both systems keep the share
#                of experts the full model keeps on that card (evals/gpu/cap_plan.py)
#   PART=qwen36  Qwen3.6-35B-A3B (--arch qwen35moe, all 40 layers, Q4_K_M), 12 GiB
#   PART=qwen3next  Qwen3-Next-80B-A3B (--arch qwen3next, Q4_K_M: 48 GiB for all 48 layers, so as many
#                as the disk holds, in fours, scaled as gptoss), 12 and 24 GiB cards
#   PART=glm     GLM-4.7-Flash (--arch deepseek2, all 47 layers, Q4_K_M), 12 and 24 GiB cards
# Each: write the GGUF, llama-bench decode (-ncmoe from cap_plan.py, -lm none, 8 threads, tg128), then
# ours (`bench decode --model FILE --gpu-memory CAP --cpu-threads 8`) on the same file; results in
# $R/PART/ (gguf.log, plan.json, pairs.txt, peer-bench.json, dec_ours_CAP.json), the ratio table
# last (python3 -m evals.gpu.quant_summary $R).
# Needs llama-bench: .peer/bin/llama-bench (a warm machine's earlier build), else .peer/export carried
# (evals/peer/restore.sh), or BENCH; with none of them it builds it while the GGUF is written
# (evals/peer/build.sh --export).
# Carry [".whl" (evals/gpu/device_wheels.sh makes it), ".peer/export", ".peer/vocab/qwen2.gguf.xz" (qwen36 / qwen3next / glm copy
# llama.cpp's qwen2 vocabulary: xz -6 of models/ggml-vocab-qwen2.gguf out of .peer/llama.cpp.tar.xz, 1.3 MB; else
# write_gguf.py takes it out of .peer/llama.cpp.tar.xz when that is carried),
# ".peer/vocab"]: gptoss builds its o200k_harmony tokenizer from bpe-openai when the machine has it, else
# reads .peer/vocab/o200k-harmony.gguf[.xz] (1.9 MB as xz: python3 evals/peer/gguf_gptoss.py --vocab-out
# .peer/vocab/o200k-harmony.gguf && xz -6 .peer/vocab/o200k-harmony.gguf, on a machine with bpe-openai).
# Env: GGUF_ARGS (more write_gguf.py options, last wins: a dry run shrinks the model with them), GGUF_FILE (a file
# of the PART's shape already written, with its .args.json, e.g. run_replay.sh's Qwen3.6 file for qwen36: no write),
# BESIDE (a command run in the background while the GGUF is written, output in beside.log, waited for before
# the timings), CAPS (comma-separated), OVERHEAD_GIB (llama.cpp's GPU use beyond weights, for -ncmoe), DEVICE (cuda;
# cpu for a dry run), NATIVE (1: build the native extension; 0 skips), BUDGET_S (560), GGUF_DIR (/tmp/peer),
# DISK_MARGIN_GIB (3; BUILD_GIB (4) more while llama-bench builds), THREADS (8, both systems), REPS / PEER_S
# (llama-bench), OUR_REPS / TOKENS / DEC_S (ours).
# A CPU dry run (tiny shapes, a CPU llama-bench or a stand-in printing llama-bench's JSON):
#   DEVICE=cpu NATIVE=0 THREADS=1 BENCH=PATH GGUF_DIR=/tmp/x R=/tmp/x-res OUR_REPS=1 TOKENS=8 REPS=1 PART=gptoss \
#   GGUF_ARGS="--layers 4 --experts 8 --hidden 64 --inter 64 --heads 4 --kv-heads 2 --head-dim 16" bash evals/gpu/run_families.sh
set -u
export OUT=${OUT:-/tmp/families}
R=${R:-/tmp/families-results}
mkdir -p "$OUT" "$R"
export PYTHONUNBUFFERED=1
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
# the cache (calibration, and the demo models the tests write) stays out of $R: packing it after every step
# took tens of seconds and made results.tar.gz too big to come back; the calibration is copied into $R
export FREETOKEN_CACHE_DIR=/tmp/families-cache
F="python3 -m freetoken_agent"
t0=$(date +%s)
pack() { find "$FREETOKEN_CACHE_DIR" -maxdepth 2 -name "calibration*.json" -exec cp {} "$R/" \; 2>/dev/null; tar -czf "$OUT/results.tar.gz" -C "$R" . 2>/dev/null; }
at() { echo "[$(( $(date +%s) - t0 )) s] $*"; pack; }  # results packed after every step: a killed call keeps them
left() { echo $(( ${BUDGET_S:-560} - ($(date +%s) - t0) )); }  # seconds this call has left
trap pack EXIT
PART=${PART:-gptoss}
DEVICE=${DEVICE:-cuda}
BENCH=${BENCH:-.peer/bin/llama-bench}
GGUF_DIR=${GGUF_DIR:-/tmp/peer}
mkdir -p "$GGUF_DIR" "$R/$PART"
D=$R/$PART
case "$PART" in
gptoss)
    GGUF=$GGUF_DIR/gpt-oss-120b.gguf
    SHAPE=gpt-oss-120b; FULL=36; CAPS=${CAPS:-12GiB,24GiB}
    vocab=()  # o200k_harmony: built from bpe-openai, else the carried vocabulary GGUF (plain or xz)
    for v in .peer/vocab/o200k-harmony.gguf .peer/vocab/o200k-harmony.gguf.xz; do
        [ -f "$v" ] || continue
        case "$v" in *.xz) xz -dc "$v" > /tmp/o200k-harmony.gguf && v=/tmp/o200k-harmony.gguf ;; esac
        vocab=(--vocab-from "$v"); break
    done
    if [ ${#vocab[@]} = 0 ] && ! python3 -c "import bpe_openai" 2> /dev/null; then
        at "no bpe-openai here and no .peer/vocab/o200k-harmony.gguf[.xz] carried"; exit 1
    fi
    WRITE=(--arch gpt-oss "${vocab[@]}")
    ;;
qwen36)
    GGUF=$GGUF_DIR/qwen3.6-35b-a3b-q4km.gguf
    SHAPE=qwen3.6-35b-a3b; FULL=40; CAPS=${CAPS:-12GiB}
    WRITE=(--arch qwen35moe --layers 40 --quant q4_k_m)
    ;;
glm)
    GGUF=$GGUF_DIR/glm-4.7-flash-q4km.gguf
    SHAPE=glm-4.7-flash; FULL=47; CAPS=${CAPS:-12GiB,24GiB}
    WRITE=(--arch deepseek2 --layers 47 --quant q4_k_m)
    ;;
qwen3next)
    GGUF=$GGUF_DIR/qwen3-next-80b-a3b-q4km.gguf
    SHAPE=qwen3-next-80b-a3b; FULL=48; CAPS=${CAPS:-12GiB,24GiB}
    WRITE=(--arch qwen3next --layers 48 --quant q4_k_m)
    ;;
*) echo "PART=$PART: one of gptoss qwen36 qwen3next glm"; exit 2 ;;
esac
if [ "$PART" != gptoss ] && [ -f .peer/vocab/qwen2.gguf.xz ]; then  # llama.cpp's qwen2 vocabulary, carried alone
    xz -dc .peer/vocab/qwen2.gguf.xz > /tmp/qwen2-vocab.gguf && WRITE+=(--vocab-from /tmp/qwen2-vocab.gguf)
fi
if [ -n "${GGUF_FILE:-}" ]; then  # an existing file of this PART's shape instead of writing one
    [ -f "$GGUF_FILE" ] && [ -f "$GGUF_FILE.args.json" ] || { echo "GGUF_FILE=$GGUF_FILE: no such file (or no .args.json)"; exit 2; }
    GGUF=$GGUF_FILE GGUF_DIR=$(dirname "$GGUF_FILE")
fi
rm -f "$GGUF_DIR"/*.gguf.part  # a killed write's leftovers would hold the room this file needs
for f in "$GGUF_DIR"/*.gguf; do [ "$f" = "$GGUF" ] || rm -f "$f" "$f.args.json"; done  # no other GGUF beside it
{ lscpu | grep -E "Model name|^CPU\(s\)"; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
  df -h "$GGUF_DIR" | tail -1; } > "$D/machine.txt"
cat "$D/machine.txt"
build=""
if [ ! -x "$BENCH" ] && ! bash evals/peer/restore.sh .peer/export > "$D/restore.log" 2>&1; then
    # no binary and no exported pieces: build it while the GGUF is written (~6 minutes on 16 cores; the pieces
    # land in $OUT for .peer/export); a rerun on the warm machine keeps the binary and the GGUF
    (bash evals/peer/build.sh --export > "$D/peer_build.log" 2>&1; echo $? > "$D/peer_build.rc") &
    build=$!
    at "building llama-bench in the background (pieces in \$OUT: keep them as .peer/export)"
fi
if [ "$PART" = gptoss ] || [ "$PART" = qwen3next ]; then  # as many layers as the disk holds: its free space (this file's old copy counted
    # as free: a different layer count rewrites it), less a margin, in GiB
    free=$(( $(df --output=avail -B1 "$GGUF_DIR" | tail -1) + $(stat -c %s "$GGUF" 2>/dev/null || echo 0) ))
    margin=${DISK_MARGIN_GIB:-3}
    [ -n "$build" ] && margin=$(( margin + ${BUILD_GIB:-4} ))  # the build's objects in /tmp while the file grows
    WRITE+=(--max-gib "$(python3 -c "print(round($free / 2**30 - $margin, 3))")")
fi
(if [ "${NATIVE:-1}" = 1 ]; then python3 native/build.py -j 16 > "$D/native_build.log" 2>&1; echo $? > "$D/native_build.rc"
  else echo skipped > "$D/native_build.rc"; fi) &
native=$!
beside=""
if [ -n "${BESIDE:-}" ]; then  # a command run while the GGUF is written (e.g. a GPU test), waited for before any timing
    (bash -c "$BESIDE" > "$D/beside.log" 2>&1; echo $? > "$D/beside.rc") &
    beside=$!
fi
wt=$(( $(left) - 120 )); [ "$wt" -ge 60 ] || wt=60  # the rest of the call after the write needs ~2 minutes
# shellcheck disable=SC2086
[ -n "${GGUF_FILE:-}" ] || timeout "$wt" python3 evals/peer/write_gguf.py "${WRITE[@]}" --seed 0 ${GGUF_ARGS:-} \
    --out "$GGUF" > "$D/gguf.log" 2>&1 || { tail -5 "$D/gguf.log"; at "gguf failed"; exit 1; }
cp "$GGUF.args.json" "$D/gguf.args.json"
at "gguf: $(du -h "$GGUF" | cut -f1), $(grep -o '"layers": [0-9]*' "$GGUF.args.json")"
PAIRS=$(python3 -m evals.gpu.cap_plan --model "$GGUF" --caps "$CAPS" --full-layers "$FULL" \
    --overhead-gib "${OVERHEAD_GIB:-1.5}" --json "$D/plan.json") || { at "cap plan failed"; exit 1; }
echo "$PAIRS" > "$D/pairs.txt"
at "pairs (ncmoe:our cap) $PAIRS"
if [ -n "$build" ]; then
    wait "$build"
    [ "$(cat "$D/peer_build.rc")" = 0 ] && [ -x "$BENCH" ] \
        || { tail -5 "$D/peer_build.log"; at "no llama-bench ($BENCH) and its build failed"; exit 1; }
    at "llama-bench built ($(grep -o 'done in [0-9.]* s' "$D/peer_build.log"))"
fi
wait $native  # a quiet machine for both systems' timings
at "native build: exit $(cat "$D/native_build.rc")"
if [ -n "$beside" ]; then wait "$beside"; at "beside: exit $(cat "$D/beside.rc"): $(tail -1 "$D/beside.log")"; fi
NCMOES=$(for p in $PAIRS; do echo "${p%%:*}"; done | awk '!seen[$0]++' | paste -sd, -)  # each -ncmoe once
python3 evals/peer/run_bench.py --bench "$BENCH" --model "$GGUF" --ncmoe "$NCMOES" --threads "${THREADS:-8}" --prompts 0 \
    --gen 128 --ubatch 512 --reps "${REPS:-2}" --load-mode none --timeout "${PEER_S:-150}" --out-dir "$D" \
    --note "$PART: the full model's cards $CAPS (plan.json)" | tail -6
at "peer done"
# the bound's B_P / B_C: bench decode looks the pair up under the bf16 key of the expert shape, packed banks too
[ "$DEVICE" = cuda ] && timeout 90 $F calibrate --shape "$SHAPE" --threads "${THREADS:-8}" --json \
    > "$D/calibration.json" 2> "$D/calibration.err"
for p in $PAIRS; do
    cap=${p#*:}
    [ "$(left)" -gt 40 ] || { at "no time left for $cap"; break; }
    gpu=(--gpu-memory "$cap")
    [ "$DEVICE" = cuda ] || gpu=()  # a CPU dry run: no cap
    timeout $(( $(left) - 20 < ${DEC_S:-200} ? $(left) - 20 : ${DEC_S:-200} )) $F bench decode --model "$GGUF" \
        --device "$DEVICE" --temperature 1000 "${gpu[@]}" --cpu-threads "${THREADS:-8}" --tokens "${TOKENS:-128}" \
        --reps "${OUR_REPS:-3}" --json > "$D/dec_ours_$cap.json" 2> "$D/dec_ours_$cap.err"
    at "ours at $cap: exit $? $(tail -1 "$D/dec_ours_$cap.err")"
done
python3 -m evals.gpu.quant_summary "$R"
at "done"
