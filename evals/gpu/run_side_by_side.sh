#!/usr/bin/env bash
# Both systems in one GPU-machine call (docs/benchmarks.md): llama.cpp (experts in pinned host
# memory, -ncmoe tuned to each cap) and freetoken-agent (the same shape with random weights, the
# paired GPU cap, the same 8 threads), decode and prefill.
# Prerequisites: evals/peer/README.md step 1 (the exported llama-bench in .peer/export); carry
# [".peer/llama.cpp.tar.xz", ".peer/export"] and the wheels; run from the repository root, wheels installed.
# PAIRS lists "ncmoe:cap" pairs that leave about the same share of experts on the GPU for both
# (default: 16:12GiB and 12:16GiB, a third and a half of the 24-layer Qwen3-30B-A3B variant: what a
# 24 GiB and a 32 GiB card hold of the full 48-layer model). SHAPE / LAYERS / GGUF_ARGS select the
# model (for Qwen3.6: SHAPE=qwen3.6-35b-a3b LAYERS=20 GGUF_ARGS="--arch qwen35moe --layers 20").
# Weights: our engine reads the same GGUF llama.cpp ran (byte-identical weights, both shapes), written
# with write_gguf.py's residual scales (since the fifth session: the routing spreads over every expert,
# as with our own random weights; the earlier files collapsed onto a few experts per layer);
# OURS=dummy makes it build random weights of the same shape in memory instead.
# PROMPTS=0 measures decode only (both systems). Everything lands in $OUT; one summary is printed last.
set -u
OUT=${OUT:-/tmp/side-by-side}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PAIRS=${PAIRS:-"16:12GiB 12:16GiB"}
SHAPE=${SHAPE:-qwen3-30b-a3b}
LAYERS=${LAYERS:-24}
GGUF_ARGS=${GGUF_ARGS:-"--layers 24 --experts 128 --top-k 8 --hidden 2048 --inter 768 --heads 32 --kv-heads 4 --head-dim 128"}
PROMPTS=${PROMPTS:-1024,4096,16384}
GGUF=/tmp/peer/$SHAPE-${LAYERS}l-bf16.gguf
[ -x .peer/bin/llama-bench ] || bash evals/peer/restore.sh .peer/export || exit 1
python3 native/build.py -j 16 >/dev/null 2>&1 || echo "native build failed"
t0=$(date +%s)
# shellcheck disable=SC2086
timeout 240 python3 evals/peer/write_gguf.py $GGUF_ARGS --seed 0 --out "$GGUF" > "$OUT/gguf.log" 2>&1 || { tail -5 "$OUT/gguf.log"; exit 1; }
echo "gguf written in $(( $(date +%s) - t0 )) s"
NCMOES=$(for p in $PAIRS; do printf '%s,' "${p%%:*}"; done)
python3 evals/peer/run_bench.py --model "$GGUF" --ncmoe "${NCMOES%,}" --threads 8 --prompts "$PROMPTS" --gen 128 \
    --ubatch 2048 --reps 3 --load-mode none --timeout 150 --out-dir "$OUT" | tail -8
echo "peer done at $(( $(date +%s) - t0 )) s"
OURS=${OURS:-gguf}
if [ "$OURS" = gguf ]; then
    # sampled near-uniform tokens, as llama-bench's random generation tokens (greedy decoding of the
    # fourth session's GGUF repeated 4 tokens: a 98 % hit rate; its routing also collapsed with
    # sampled tokens, fifth session, which the residual scales fix)
    MODEL=(--model "$GGUF")
    DECODE_ARGS=(--temperature "${TEMPERATURE:-1000}")
else
    rm -f "$GGUF"  # the disk holds one ~30 GiB model at a time; ours is made in memory
    MODEL=(--shape "$SHAPE" --layers "$LAYERS" --dummy)
    DECODE_ARGS=()
fi
F="python3 -m freetoken_agent"
$F calibrate --shape "$SHAPE" --threads 8 --json > "$OUT/calibration.json" 2>/dev/null
# FETCHES="dma split split+adapt" runs ours once per variant against the same llama.cpp run,
# each into $OUT/ours_<variant>/ with its own summary: "dma" whole experts (FREETOKEN_SPLIT_EXPERT=0),
# "split" FREETOKEN_SPLIT_EXPERT=1, "+adapt" adds FREETOKEN_ADAPT_RATIO=1, "+overlap"
# FREETOKEN_OVERLAP_DECODE=1 (the next pass queued before this one's tokens are read; else serial,
# the default; "+serial" is accepted and changes nothing);
# (each variant's directory: ours_<variant> with "+" as "-", a name the device tool brings back);
# unset: one run as the environment says
run_ours() {  # $1: the directory ours writes to
local out=$1 seen=" " p cap
for p in $PAIRS; do
    cap=${p#*:}
    case "$seen" in *" $cap "*) continue ;; esac  # two -ncmoe for one cap: ours runs once
    seen="$seen$cap "
    timeout "${DEC_S:-240}" $F bench decode "${MODEL[@]}" "${DECODE_ARGS[@]+"${DECODE_ARGS[@]}"}" --gpu-memory "$cap" \
        --cpu-threads 8 --tokens 128 --reps 3 --json > "$out/dec_ours_$cap.json" 2> "$out/dec_ours_$cap.err"
    echo "decode $cap: exit $? at $(( $(date +%s) - t0 )) s"
    [ "$PROMPTS" = 0 ] && continue  # decode only (llama-bench runs no prompt test for -p 0 either)
    timeout "${PRE_S:-100}" $F bench prefill "${MODEL[@]}" --gpu-memory "$cap" \
        --cpu-threads 8 --prompt-tokens "$PROMPTS" --chunk 8192 --json > "$out/pre_ours_$cap.json" 2> "$out/pre_ours_$cap.err"
    echo "prefill $cap: exit $? at $(( $(date +%s) - t0 )) s"
done
}
if [ -z "${FETCHES:-}" ]; then
    run_ours "$OUT"
else
    for fetch in $FETCHES; do
        mkdir -p "$OUT/ours_${fetch//+/-}" && cp "$OUT/peer-bench.json" "$OUT/ours_${fetch//+/-}/"
        echo "== ours: $fetch"
        split=0 adapt=0 overlap=0
        [ "${fetch%%+*}" = split ] && split=1
        case "$fetch" in *+adapt*) adapt=1 ;; esac
        case "$fetch" in *+overlap*) overlap=1 ;; esac
        FREETOKEN_SPLIT_EXPERT=$split FREETOKEN_ADAPT_RATIO=$adapt FREETOKEN_OVERLAP_DECODE=$overlap \
            run_ours "$OUT/ours_${fetch//+/-}"
    done
fi
rm -f "$GGUF"
if [ -z "${FETCHES:-}" ]; then
    python3 -m evals.gpu.summary "$OUT"
    python3 -m evals.gpu.side_by_side "$OUT" $PAIRS
else
    for fetch in $FETCHES; do
        echo "== ours: $fetch"
        python3 -m evals.gpu.summary "$OUT/ours_${fetch//+/-}"
        python3 -m evals.gpu.side_by_side "$OUT/ours_${fetch//+/-}" $PAIRS
    done
fi
