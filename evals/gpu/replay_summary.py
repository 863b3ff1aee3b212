"""The side-by-side table of `eval replay` runs on several servers (evals/gpu/run_replay.sh).

Contract:
    python3 -m evals.gpu.replay_summary RESULTS_DIR [--json PATH]
reads every RESULTS_DIR/SYSTEM/.../result.json that `freetoken-agent eval replay` wrote (SYSTEM: the
first folder under RESULTS_DIR, e.g. `ours` and `peer`) and prints a Markdown table, one row per run
(trace) and system, `ours` first: requests, failed, worst / median / mean TTFT in seconds (median over
the run's answered turns with a TTFT, from its turns; worst and mean are the run's `worst_ttft_ms` and
`mean_ttft_ms`), the run's mean decode tok/s, the result's single-turn `baseline_decode_tps`, the run's
`decode_drop` (1 - mean / baseline), the run's recomputed tokens, the worst TTFT over `ours`' worst on
the same trace, and the GPU memory peak of the system (SYSTEM/gpu_mem.txt: nvidia-smi memory.used
samples in MiB, the first taken before its server started: the peak less that one). A trace one
system has and another lacks (its replay cut by a timeout: no result.json) is a row saying so. Then
one line per trace against the issue's goal: ours worst under 20 s, decode drop at most 8 %.
SYSTEM/cmd.txt, when present, is printed as the system's command, and SYSTEM/serve.log's compiles and
captures after the warm-up (`late_work`) as their count, seconds and the slowest. `rows(root)` returns the rows as
dicts; --json writes them.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

GOAL_WORST_S = 20.0
GOAL_DROP = 0.08
COLUMNS = ("trace", "system", "requests", "failed", "worst_ttft_s", "median_ttft_s", "mean_ttft_s",
           "decode_tps", "baseline_tps", "decode_drop", "recomputed", "worst_vs_ours", "gpu_peak_mib")


def _s(ms: float | None) -> float | None:
    return None if ms is None else round(ms / 1000, 2)


def _gpu_peak(system_dir: Path) -> int | None:
    f = system_dir / "gpu_mem.txt"
    if not f.is_file():
        return None
    vals = [int(x) for x in f.read_text().split() if x.strip().isdigit()]
    return max(vals) - vals[0] if len(vals) > 1 else None


def _order(system: str) -> tuple[int, str]:
    return ({"ours": 0, "peer": 1}.get(system, 2), system)


def rows(root: Path) -> list[dict[str, Any]]:
    found: dict[tuple[str, str], dict[str, Any]] = {}
    systems = {p.name for p in root.iterdir()
               if p.is_dir() and ((p / "cmd.txt").is_file() or any(p.rglob("result.json")))}
    for f in sorted(root.glob("*/**/result.json")):
        system = f.relative_to(root).parts[0]
        try:
            result = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"replay_summary: {f}: not a readable result.json ({e})") from None
        for run in result.get("runs") or []:
            turns = [t for t in result.get("turns") or [] if t.get("run") == run["run"]]
            ttfts = [t["ttft_ms"] for t in turns if t.get("status") == 200 and t.get("ttft_ms") is not None]
            found[(run["run"], system)] = {
                "trace": run["run"], "system": system, "requests": run.get("requests"), "failed": run.get("failed"),
                "worst_ttft_s": _s(run.get("worst_ttft_ms")),
                "median_ttft_s": _s(statistics.median(ttfts)) if ttfts else None,
                "mean_ttft_s": _s(run.get("mean_ttft_ms")), "decode_tps": run.get("mean_decode_tps"),
                "baseline_tps": result.get("baseline_decode_tps"), "decode_drop": run.get("decode_drop"),
                "recomputed": run.get("recomputed_tokens"), "worst_vs_ours": None,
                "gpu_peak_mib": _gpu_peak(root / system), "finished": True}
    traces = list(dict.fromkeys(t for t, _ in found))
    out = []
    for trace in traces:
        ours = found.get((trace, "ours"))
        for system in sorted(systems, key=_order):
            row = found.get((trace, system)) or {**dict.fromkeys(COLUMNS), "trace": trace, "system": system,
                                                 "finished": False}
            if ours and ours["worst_ttft_s"] and row["worst_ttft_s"] is not None:
                row["worst_vs_ours"] = round(row["worst_ttft_s"] / ours["worst_ttft_s"], 2)
            out.append(row)
    return out


def _cell(v: Any) -> str:
    return "-" if v is None else str(v)


def markdown(table: list[dict[str, Any]], root: Path | None = None) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|---|---|" + "---:|" * (len(COLUMNS) - 2)]
    for r in table:
        if not r["finished"]:
            lines.append(f"| {r['trace']} | {r['system']} | not finished (no result.json) |" + " |" * (len(COLUMNS) - 3))
            continue
        lines.append("| " + " | ".join(_cell(r[c]) for c in COLUMNS) + " |")
    lines.append("")
    for r in table:
        if r["system"] != "ours":
            continue
        peer = [p for p in table if p["trace"] == r["trace"] and p["system"] != "ours"]
        worst, drop = r["worst_ttft_s"], r["decode_drop"]
        goal = [f"worst {worst} s ({'under' if worst is not None and worst < GOAL_WORST_S else 'NOT under'} "
                f"{GOAL_WORST_S:g} s)" if r["finished"] else "not finished",
                f"decode drop {drop} ({'within' if drop is not None and drop <= GOAL_DROP else 'NOT within'} "
                f"{GOAL_DROP:.0%})"]
        goal += [f"{p['system']} worst {p['worst_ttft_s']} s" if p["finished"] else f"{p['system']} not finished"
                 for p in peer]
        lines.append(f"- {r['trace']}: ours " + ", ".join(goal))
    if root is not None:
        for p in sorted((q for q in root.glob("*/cmd.txt")), key=lambda q: _order(q.parent.name)):
            lines.append(f"- {p.parent.name}: `{p.read_text().strip()}`")
        for p in sorted((q for q in root.glob("*/serve.log")), key=lambda q: _order(q.parent.name)):
            lines.extend(late_work(p))
    return "\n".join(lines) + "\n"


_LATE = re.compile(r"freetoken-agent: (compile|capture) after the warm-up: (.*) \(([0-9.]+) s\)$")


def late_work(log: Path, top: int = 5) -> list[str]:
    """What a server log says was compiled or captured after its warm-up (engine/late_work.py): one
    line with the count and seconds of each kind, then the `top` slowest."""
    found = [(m.group(1), m.group(2), float(m.group(3)))
             for m in map(_LATE.match, log.read_text(errors="replace").splitlines()) if m]
    if not found:
        return [f"- {log.parent.name}: nothing compiled or captured after the warm-up"]
    kinds = sorted({k for k, _, _ in found})
    out = [f"- {log.parent.name} after the warm-up: " + ", ".join(
        f"{sum(k == kind for k, _, _ in found)} {kind}s, {sum(s for k, _, s in found if k == kind):.1f} s"
        for kind in kinds)]
    out += [f"  - {k} {what}: {s:.2f} s" for k, what, s in sorted(found, key=lambda f: -f[2])[:top]]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    table = rows(args.results)
    if args.json is not None:
        args.json.write_text(json.dumps(table, indent=1))
    print(markdown(table, args.results), end="")
    return 0 if table else 1


if __name__ == "__main__":
    sys.exit(main())
