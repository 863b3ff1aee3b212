#!/usr/bin/env bash
# Both systems in one GPU-machine call (../shared/BENCHMARKS.md): llama.cpp (experts in pinned host
# memory, -ncmoe 16: one third resident) and freetoken-agent (the same 24-layer Qwen3-30B-A3B shape,
# a GPU cap that leaves one third of the experts resident, the same 8 threads), decode and prefill.
# Prerequisites: evals/peer/README.md step 1 (the exported llama-bench in .peer/export); carry
# [".whl", ".peer/llama.cpp.tar.xz", ".peer/export"]; run from the repository root, wheels installed.
# Everything lands in $OUT; one summary is printed last. NCMOE / CAP override the pairing.
set -u
OUT=${OUT:-/tmp/side-by-side}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
NCMOE=${NCMOE:-16}
CAP=${CAP:-12GiB}
GGUF=/tmp/peer/qwen3moe-24l-bf16.gguf
[ -x .peer/bin/llama-bench ] || bash evals/peer/restore.sh .peer/export || exit 1
python3 native/build.py -j 16 >/dev/null 2>&1 || echo "native build failed"
python3 evals/peer/write_gguf.py --layers 24 --experts 128 --top-k 8 --hidden 2048 --inter 768 --heads 32 \
    --kv-heads 4 --head-dim 128 --seed 0 --out "$GGUF" || exit 1
python3 evals/peer/run_bench.py --model "$GGUF" --ncmoe "$NCMOE" --threads 8 --prompts 1024,4096,16384 --gen 128 \
    --ubatch 2048 --reps 3 --load-mode none --timeout 200 --out-dir "$OUT"
rm -f "$GGUF"  # the disk holds one 29 GiB model at a time; ours is made in memory
F="python3 -m freetoken_agent"
$F calibrate --shape qwen3-30b-a3b --threads 8 --json > "$OUT/calibration.json" 2>/dev/null
timeout 150 $F bench decode --shape qwen3-30b-a3b --layers 24 --dummy --gpu-memory "$CAP" --cpu-threads 8 \
    --tokens 128 --reps 3 --json > "$OUT/dec_ours.json" 2> "$OUT/dec_ours.err"
timeout 120 $F bench prefill --shape qwen3-30b-a3b --layers 24 --dummy --gpu-memory "$CAP" --cpu-threads 8 \
    --prompt-tokens 1024,4096,16384 --chunk 8192 --json > "$OUT/pre_ours.json" 2> "$OUT/pre_ours.err"
python3 -m evals.gpu.summary "$OUT"
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
try:
    peer = json.loads((out / "peer-bench.json").read_text())
    ours = json.loads((out / "dec_ours.json").read_text())
except (OSError, json.JSONDecodeError) as e:
    sys.exit(f"no side-by-side ratio: {e}")
for cfg in peer.get("summary", peer.get("configs", [])):
    tg = next(iter(cfg.get("decode", {}).values()), {}).get("tok_s")
    if tg:
        print(f"llama.cpp ncmoe {cfg.get('ncmoe')}: decode {tg:.1f} tok/s, peak GPU {cfg.get('gpu_mem_peak_mib')} MiB; "
              f"ours {ours['tok_s']:.1f} tok/s -> {ours['tok_s'] / tg:.2f}x")
PY
