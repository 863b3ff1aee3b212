#!/usr/bin/env bash
# One GPU-machine run for issue 25 (one engine you can read): the whole GPU test suite on this tree,
# then `bench decode` on one dummy shape at the commit before the issue (586b9ef) and at this tree,
# in the same call, and a short table last. Each device call must end within 10 minutes, so it runs
# in parts (PART, one per call):
#   PART=tests1   the first half of the GPU tests (evals/gpu/run_issue6.sh TESTS=all1), ~8 min
#   PART=tests2   the second half (TESTS=all2), ~6 min
#   PART=bench    the calibration, then the decode bench at the old commit and at this tree, old / new /
#                 old / new (a second pair when BENCH_PAIRS=2, the default), ~5 min
# Test names and failures land in $OUT/gpu_tests.log; the bench JSON in $OUT/dec_{old,new}_N.json.
#
# The old commit travels as an ignored folder (~1 MB), made on the machine the call starts from:
#   mkdir -p .issue25
#   git archive 586b9ef engine native freetoken_agent evals/__init__.py evals/gpu setup.py pyproject.toml | tar -x -C .issue25
#   grep -qx '/.issue25/' .git/info/exclude || echo '/.issue25/' >> .git/info/exclude
# and the call carries it: carry [".issue25"]. Run from the repository root:
#   OUT=$OUT PART=bench bash evals/gpu/run_issue25.sh
set -u
OUT=${OUT:-/tmp/issue25}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export FREETOKEN_CACHE_DIR="$OUT/cache"  # one calibration for both trees
SHAPE=${SHAPE:-qwen3-30b-a3b}
LAYERS=${LAYERS:-24}
CAP=${CAP:-16GiB}
BENCH_ARGS=(bench decode --shape "$SHAPE" --layers "$LAYERS" --dummy --gpu-memory "$CAP" --cpu-threads 8
            --tokens 128 --reps 3 --json)
case "${PART:-bench}" in
    tests1) TESTS=all1 BENCH=0 TEST_S=${TEST_S:-540} OUT="$OUT" bash evals/gpu/run_issue6.sh; exit $? ;;
    tests2) TESTS=all2 BENCH=0 TEST_S=${TEST_S:-540} OUT="$OUT" bash evals/gpu/run_issue6.sh; exit $? ;;
    bench) ;;
    *) echo "PART must be tests1, tests2 or bench"; exit 2 ;;
esac
OLD=${OLD:-.issue25}
[ -f "$OLD/engine/engine.py" ] || { echo "no old tree in $OLD (see this script's header)"; exit 1; }
t0=$(date +%s)
python3 native/build.py -j 16 > "$OUT/build_new.log" 2>&1 || { echo "native build failed (new)"; tail -5 "$OUT/build_new.log"; }
(cd "$OLD" && python3 native/build.py -j 16 > "$OUT/build_old.log" 2>&1) || { echo "native build failed (old)"; tail -5 "$OUT/build_old.log"; }
echo "native builds done at $(( $(date +%s) - t0 )) s"
PYTHONPATH=$PWD timeout 60 python3 -m freetoken_agent calibrate --shape "$SHAPE" --threads 8 --json \
    > "$OUT/calibration.json" 2> "$OUT/calibration.err"
echo "calibration done at $(( $(date +%s) - t0 )) s"
run() {  # $1: old | new, $2: index
    local dir=$PWD
    [ "$1" = old ] && dir=$OLD
    (cd "$dir" && PYTHONPATH=$PWD timeout "${DEC_S:-90}" python3 -m freetoken_agent "${BENCH_ARGS[@]}") \
        > "$OUT/dec_$1_$2.json" 2> "$OUT/dec_$1_$2.err"
    echo "$1 $2: exit $? at $(( $(date +%s) - t0 )) s"
}
for i in $(seq 1 "${BENCH_PAIRS:-2}"); do
    run old "$i"
    run new "$i"
done
python3 - "$OUT" <<'EOF'
import json, pathlib, statistics, sys
out = pathlib.Path(sys.argv[1])
rows = {}
for p in sorted(out.glob("dec_*_*.json")):
    tree = p.stem.split("_")[1]
    try:
        r = json.loads(p.read_text().strip().splitlines()[-1])
    except (ValueError, IndexError):
        print(f"{p.name}: no result ({(out / (p.stem + '.err')).read_text()[-300:]!r})")
        continue
    rows.setdefault(tree, []).append(r)
print("| tree | tok/s per run (median of 3 reps) | ms/token | hit rate | dense ms | executor |")
print("| --- | --- | --- | --- | --- | --- |")
for tree in ("old", "new"):
    rs = rows.get(tree, [])
    if not rs:
        print(f"| {tree} | - | - | - | - | - |")
        continue
    rates = " / ".join("%.1f" % r["tok_s"] for r in rs)
    ms = statistics.median(r["ms_per_token"] for r in rs)
    dense = statistics.median(r["dense_ms"] for r in rs)
    hit = rs[-1]["hit_rate"]
    hit_text = "-" if hit is None else f"{hit:.3f}"
    print(f"| {tree} | {rates} | {ms:.2f} | {hit_text} | {dense:.2f} | {rs[-1]['executor'][:80]} |")
if rows.get("old") and rows.get("new"):
    old = statistics.median(r["tok_s"] for r in rows["old"])
    new = statistics.median(r["tok_s"] for r in rows["new"])
    print(f"new / old decode tok/s: {new / old:.3f} (runs' spread: old {min(r['tok_s'] for r in rows['old']):.1f}-"
          f"{max(r['tok_s'] for r in rows['old']):.1f}, new {min(r['tok_s'] for r in rows['new']):.1f}-"
          f"{max(r['tok_s'] for r in rows['new']):.1f})")
EOF
