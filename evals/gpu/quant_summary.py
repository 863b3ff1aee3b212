"""Prints the packed CPU kernels' and the packed GEMV probe's results from a run_issue26.sh results
folder (python3 -m evals.gpu.quant_summary DIR): GB/s of packed bytes against the read bound; and,
for each sub-folder of a run_families.sh run (one with a pairs.txt), its side-by-side table
(evals/gpu/side_by_side.py: decode tok/s of both, the ratio, hit rate, measured / bound, peak GPU
memory) under one line per cap saying which card of the full model it stands for (plan.json)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from evals.gpu.side_by_side import rows


def families(out: Path) -> None:
    for pairs in sorted(out.glob("*/pairs.txt")):
        d = pairs.parent
        try:
            stamp = json.loads((d / "gguf.args.json").read_text())
            plans = json.loads((d / "plan.json").read_text())["plans"]
        except (OSError, ValueError, KeyError):
            stamp, plans = {}, []
        print(f"\n{d.name}: {stamp.get('arch', '?')} GGUF, {stamp.get('layers', '?')} layers, "
              f"{stamp.get('quant', 'bf16')}, random weights (seed {stamp.get('seed', '?')})")
        for p in plans:
            print(f"  card {p['cap_gib']:.0f} GiB of the full {p['full_layers']}-layer model: {p['share']:.0%} of its "
                  f"experts resident; on this {p['file_layers']}-layer file ours --gpu-memory {p['ours_gib']:.2f}GiB, "
                  f"llama.cpp -ncmoe {p['ncmoe']} ({p['peer_gpu_layers']} layers' experts on the GPU)")
        try:
            print("\n".join(rows(d, pairs.read_text().split())))
        except (TypeError, KeyError, ValueError) as e:  # a result without a GPU (a dry run): its raw figures
            print(f"  (no table: {e!r})")
            for path in sorted(d.glob("dec_ours_*.json")):
                r = json.loads(path.read_text())
                print(f"  {path.stem}: {r.get('tok_s')} tok/s, hit {r.get('hit_rate')}, peak {r.get('peak_gpu_bytes')}")
            try:
                peer = json.loads((d / "peer-bench.json").read_text())["configs"]
            except (OSError, ValueError, KeyError):
                peer = []
            for c in peer:
                print(f"  llama.cpp -ncmoe {c.get('ncmoe')}: {c.get('decode')}")


def main(out: Path) -> None:
    for path in sorted(out.glob("cpu_*.json")):
        try:
            rows_ = json.loads(path.read_text())
        except (OSError, ValueError):
            print(f"{path.stem}: no result")
            continue
        for r in rows_ if isinstance(rows_, list) else [rows_]:
            print(f"{path.stem:18s} {r['format']} {r.get('isa') or '':10s} {r['threads']:>2} threads: {r['weight_gbps']:.1f} GB/s, read bound "
                  f"{r['read_bound_gbps']:.1f} GB/s: {r['fraction_of_bound']:.2f}")
    probe = out / "gemv.jsonl"
    if probe.exists():
        print(probe.read_text().strip())
    families(out)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
