#!/usr/bin/env bash
# The native CPU expert executor's acceptance run (issue 4), as recorded in docs/benchmarks.md.
# Builds the extension in place, checks every SIMD path against float64, then benchmarks at batch 1.
# Usage: OUT=dir bash evals/native/run_bench.sh [THREADS]   (THREADS default "6,8,16")
set -uo pipefail
OUT="${OUT:-/tmp/ftbench}"; mkdir -p "$OUT"
THREADS="${1:-6,8,16}"
PY="${PYTHON:-python3}"
bench() { "$PY" -m freetoken_agent bench cpu-experts "$@"; }

lscpu | grep -E "Model name|^CPU\(s\)|Thread|Core|Socket|L2|L3|NUMA node\(s\)" | tee "$OUT/lscpu.txt"
"$PY" native/build.py -j "$(nproc)" 2>&1 | tail -1

echo "== bf16, qwen3-30b-a3b layer (top-8), batch 1, every ISA, threads $THREADS"
bench --threads "$THREADS" --isa all --bank-gb 8 --rounds 3 --seconds 1 --json | tee "$OUT/bf16.json"
for fmt in fp8 mxfp4; do
  echo "== $fmt, batch 1"
  bench --format "$fmt" --threads "$THREADS" --bank-gb 8 --rounds 3 --seconds 0.5 --json | tee "$OUT/$fmt.json"
done
echo "== gpt-oss-120b mxfp4 (top-4), batch 1"
bench --shape gpt-oss-120b --format mxfp4 --threads "$THREADS" --bank-gb 4 --rounds 2 --seconds 0.5 --json | tee "$OUT/gptoss.json"
echo "== avx512bf16 vs avx512 at 16 threads: prefetch distance, and an L3-resident bank (compute, not DRAM)"
for pf in 0 2048; do
  FREETOKEN_NATIVE_PREFETCH=$pf bench --threads 16 --isa avx512bf16,avx512 --bank-gb 4 --rounds 2 --seconds 0.5 --no-torch --json | tee "$OUT/pf$pf.json"
done
bench --threads 1,16 --isa avx512bf16,avx512 --bank-gb 0.08 --rounds 2 --seconds 0.5 --no-torch --json | tee "$OUT/l3.json"
echo "== batch 4 and 16 (bf16, 16 threads)"
bench --threads 16 --batch 4 --bank-gb 4 --rounds 2 --seconds 0.5 --json | tee "$OUT/b4.json"
bench --threads 16 --batch 16 --bank-gb 4 --rounds 2 --seconds 0.5 --json | tee "$OUT/b16.json"
echo "== correctness of every SIMD path on this CPU (float64 reference)"
FREETOKEN_REQUIRE_NATIVE=1 OMP_NUM_THREADS=8 timeout 300 "$PY" -m pytest -q -p no:cacheprovider tests/native 2>&1 | tail -3
