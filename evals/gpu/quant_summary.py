"""Prints the packed CPU kernels' and the packed GEMV probe's results from a run_issue26.sh results
folder (python3 -m evals.gpu.quant_summary DIR): GB/s of packed bytes against the read bound."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(out: Path) -> None:
    for path in sorted(out.glob("cpu_*.json")):
        try:
            rows = json.loads(path.read_text())
        except (OSError, ValueError):
            print(f"{path.stem}: no result")
            continue
        for r in rows if isinstance(rows, list) else [rows]:
            print(f"cpu {r['format']} {r['threads']:>2} threads: {r['weight_gbps']:.1f} GB/s, read bound "
                  f"{r['read_bound_gbps']:.1f} GB/s: {r['fraction_of_bound']:.2f}")
    probe = out / "gemv.jsonl"
    if probe.exists():
        print(probe.read_text().strip())


if __name__ == "__main__":
    main(Path(sys.argv[1]))
