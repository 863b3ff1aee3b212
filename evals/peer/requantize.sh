#!/usr/bin/env bash
# requantize.sh - make a GGUF with llama.cpp's own llama-quantize from a Q8_0 source written by write_gguf.py.
#
# Contract:
#   bash evals/peer/requantize.sh --out OUT [--type Q4_K_M] [--threads N] [--quantize BIN] [--keep-source]
#        [-- WRITE_GGUF_ARGS...]
#   - writes SRC = OUT.q8_0.gguf with `python3 evals/peer/write_gguf.py --quant q8_0 --out SRC
#     WRITE_GGUF_ARGS...` (every layer the arguments ask for; no --quant of their own), then runs
#     `BIN --allow-requantize SRC OUT.part TYPE N` (BIN: --quantize, default .peer/bin/llama-quantize,
#     built by `evals/peer/build.sh --quantize`; N: --threads, default nproc) and renames OUT.part to OUT;
#   - deletes SRC when done, also on failure (the GPU machine's disk holds one of the two at a time
#     only for the big shapes), unless --keep-source;
#   - writes OUT.args.json: {"quantizer": "llama-quantize", "type", "command" (the llama-quantize
#     argv), "write_gguf" (write_gguf.py's argv), "source_args" (the source's own OUT.args.json)}; a
#     later call whose OUT.args.json holds the same type and source arguments leaves OUT alone;
#   - the type of each tensor in OUT is llama-quantize's choice (for Q4_K_M the map that
#     `write_gguf.py --quant q4_k_m` writes directly: tests/engine/test_peer_requantize.py);
#   - exits non-zero with a one-line reason on any failure. $PYTHON (default python3) runs write_gguf.py.
#   - disk: the source and OUT coexist until the end (qwen3moe, 48 layers, write_gguf.py --plan: Q8_0
#     30.25 GiB, Q4_K_M 17.28 GiB); write_gguf.py checks the room for the source only.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-python3}"
OUT="" TYPE=Q4_K_M THREADS="$(nproc)" BIN="$REPO/.peer/bin/llama-quantize" KEEP=0
die() { echo "requantize.sh: $*" >&2; exit 1; }
while (( $# )); do
    case "$1" in
        --out) OUT="$2"; shift 2 ;;
        --type) TYPE="$2"; shift 2 ;;
        --threads) THREADS="$2"; shift 2 ;;
        --quantize) BIN="$2"; shift 2 ;;
        --keep-source) KEEP=1; shift ;;
        --) shift; break ;;
        -h|--help) awk 'NR > 1 && /^set -euo/ {exit} NR > 1' "$0"; exit 0 ;;
        *) echo "requantize.sh: unknown argument: $1" >&2; exit 2 ;;
    esac
done
[[ -n "$OUT" ]] || die "--out is required"
[[ -x "$BIN" ]] || die "$BIN is not an executable llama-quantize (bash evals/peer/build.sh --quantize)"
for a in "$@"; do [[ "$a" != --quant && "$a" != --out ]] || die "WRITE_GGUF_ARGS must not give $a"; done

SRC="$OUT.q8_0.gguf"
STAMP="$OUT.args.json"
WG=("$PY" "$REPO/evals/peer/write_gguf.py" --quant q8_0 --out "$SRC" "$@")
QZ=("$BIN" --allow-requantize "$SRC" "$OUT.part" "$TYPE" "$THREADS")

# the source's own stamp says what its bytes depend on: reuse OUT when it was made from the same
if [[ -f "$OUT" && -f "$STAMP" ]] && "$PY" - "$STAMP" "$TYPE" "$@" <<'PY'
import json, sys
stamp, typ, args = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3:]
sys.exit(0 if stamp.get("type") == typ and stamp.get("write_gguf_args") == args else 1)
PY
then
    echo "requantize.sh: $OUT already holds $TYPE of these arguments ($STAMP): left alone"
    exit 0
fi

(( KEEP )) || trap 'rm -f "$SRC" "$SRC.args.json" "$OUT.part"' EXIT
rm -f "$OUT" "$STAMP"
echo "== requantize.sh: ${WG[*]}"
"${WG[@]}" || die "write_gguf.py failed"
echo "== requantize.sh: ${QZ[*]}"
t0=$(date +%s.%N)
"${QZ[@]}" > "$OUT.quantize.log" 2>&1 || { tail -20 "$OUT.quantize.log" >&2; die "llama-quantize failed (log: $OUT.quantize.log)"; }
grep -E "model size|quant size" "$OUT.quantize.log" || true
mv "$OUT.part" "$OUT"
"$PY" - "$STAMP" "$TYPE" "$SRC.args.json" "${#QZ[@]}" "${QZ[@]}" "${WG[@]}" <<'PY'
import json, os, sys
stamp, typ, src_stamp, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
qz, wg = sys.argv[5:5 + n], sys.argv[5 + n:]
qz = [a if not a.endswith(".part") else a[: -len(".part")] for a in qz]
args = wg[wg.index("--out") + 2:]
rec = {"quantizer": "llama-quantize", "type": typ, "command": qz, "write_gguf": wg, "write_gguf_args": args,
       "source_args": json.load(open(src_stamp))}
with open(stamp + ".tmp", "w") as f:
    json.dump(rec, f, indent=1)
os.replace(stamp + ".tmp", stamp)
PY
echo "== requantize.sh: wrote $OUT ($(du -h "$OUT" | cut -f1)) in" \
     "$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s of llama-quantize; $STAMP"
