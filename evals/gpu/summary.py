"""Prints one table from the JSON files of evals/gpu/run_issue6.sh (python -m evals.gpu.summary DIR)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(out: Path) -> None:
    for path in sorted(out.glob("*.json")):
        try:
            r = json.loads(path.read_text())
        except (json.JSONDecodeError, OSError):
            print(f"{path.stem}: no result")
            continue
        if r.get("bench") == "decode":
            print(f"{path.stem}: {r['tok_s']:.1f} tok/s ({r['ms_per_token']:.1f} ms), hit {r['hit_rate']}, "
                  f"fetched/tok {r['fetched_per_token']:.1f}, split/tok {r.get('split_per_token', 0):.1f}, "
                  f"cpu/tok {r['cpu_misses_per_token']:.1f} "
                  f"(CPU branch {r.get('cpu_branch_ms_per_token', 0):.2f} ms), "
                  f"dense {r['dense_ms']:.1f} ms, bound {r['bound_ms']} ms, measured/bound {r['measured_over_bound']}, "
                  f"peak {r['peak_gpu_bytes'] / 2**30:.2f} GiB of {r['gpu_memory'] / 2**30:.0f}, "
                  f"overlapped passes {r.get('overlapped_share', 0.0):.0%}")
            if (lt := r.get("layer_timeline")) and lt.get("gpu_gap_us") is not None:
                fetch = "" if lt.get("fetch_us") is None else \
                    f", fetch {lt['fetch_us']:.0f} us ({100 * lt['fetch_late_share']:.0f} % after the CPU)"
                print(f"{path.stem}: per layer CPU {lt['cpu_us']:.0f} us + GPU alone {lt['gpu_gap_us']:.0f} us{fetch}, "
                      f"x {lt['layers_per_token']:.1f} layers; {r.get('step_rest_ms') or 0:.2f} ms/token outside")
        elif r.get("bench") == "prefill":
            for run in r["runs"]:
                print(f"{path.stem} {run['prompt_tokens']}: TTFT {run['ttft_s']:.2f} s, {run['prefill_tok_s']:.0f} tok/s, "
                      f"bound {run['bound_s']:.2f} s, measured/bound {run['measured_over_bound']:.2f}, "
                      f"streamed {run.get('streamed_experts', 0):.0f} experts, "
                      f"unused share {run.get('streamed_unused_share')}")
            print(f"{path.stem}: peak {r['peak_gpu_bytes'] / 2**30:.2f} GiB of {r['gpu_memory'] / 2**30:.0f}")
        elif "b_cpu" in r:
            print(f"{path.stem}: B_C {r['b_cpu']} B_P {r['b_pcie']} contended {r['b_cpu_contended']} + "
                  f"{r['b_pcie_contended']} ratio {r.get('ratio')}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
