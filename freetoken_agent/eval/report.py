"""The report every eval writes: per turn and per run, as JSON, a Markdown table and PNG plots.

Contract: a turn is a dict with at least `run`, `index`, `status`, and (None when unknown)
`prompt_tokens`, `reused_tokens`, `recomputed_tokens`, `truly_new_tokens`, `ttft_ms`,
`decode_tps`, `completion_tokens`, `divergence_cause`, `expert_cache_hit_rate`. `summarise(turns)`
gives one run's aggregates: requests, failed, token sums, recomputed / truly new, mean and worst
TTFT, mean decode tok/s. `add_decode_drop(result, baseline)` records the single-turn baseline
(`baseline_decode_tps`) and each run's `decode_drop`, 1 - mean decode / baseline (the paper keeps
it within 12 %). `write(out_dir, result)` writes `result.json` (the whole result),
`report.md` (`markdown(result)`) and, when the result has turns with a TTFT, `ttft.png` (TTFT per
turn, one line per run) and `tokens.png` (reused vs recomputed tokens per turn, stacked), with
matplotlib's non-interactive backend; it returns the paths written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TURN_COLUMNS = ("run", "index", "status", "prompt_tokens", "reused_tokens", "recomputed_tokens",
                "truly_new_tokens", "ttft_ms", "decode_tps", "completion_tokens", "divergence_cause",
                "expert_cache_hit_rate")


def _sum(turns: list[dict[str, Any]], key: str) -> int | None:
    vals = [t[key] for t in turns if t.get(key) is not None]
    return sum(vals) if vals else None


def summarise(turns: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [t for t in turns if t.get("status") == 200]
    ttfts = [t["ttft_ms"] for t in ok if t.get("ttft_ms") is not None]
    tps = [t["decode_tps"] for t in ok if t.get("decode_tps") is not None]
    rec, new = _sum(ok, "recomputed_tokens"), _sum(ok, "truly_new_tokens")
    return {"requests": len(turns), "failed": len(turns) - len(ok),
            "prompt_tokens": _sum(ok, "prompt_tokens"), "reused_tokens": _sum(ok, "reused_tokens"),
            "recomputed_tokens": rec, "truly_new_tokens": new,
            "recomputed_per_new": round(rec / new, 3) if rec is not None and new else None,
            "mean_ttft_ms": round(sum(ttfts) / len(ttfts), 1) if ttfts else None,
            "worst_ttft_ms": round(max(ttfts), 1) if ttfts else None,
            "mean_decode_tps": round(sum(tps) / len(tps), 2) if tps else None}


def add_decode_drop(result: dict[str, Any], baseline: float | None) -> dict[str, Any]:
    result["baseline_decode_tps"] = baseline
    for run in result.get("runs") or []:
        mean = run.get("mean_decode_tps")
        run["decode_drop"] = round(1 - mean / baseline, 3) if mean is not None and baseline else None
    return result


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.1f}" if abs(v) >= 10 else f"{v:.3g}"
    if isinstance(v, list):
        return ", ".join(str(x) for x in v if x) or "-"
    return str(v).replace("|", "/")


def markdown(result: dict[str, Any]) -> str:
    lines = [f"# freetoken-agent eval {result.get('eval', '')}", ""]
    for k in ("base_url", "model", "forced", "client", "baseline_decode_tps", "note"):
        if result.get(k) is not None:
            lines.append(f"- {k}: {result[k]}")
    lines += ["", "## Runs", ""]
    runs = result.get("runs") or []
    keys = [k for k in ("success", "requests", "failed", "prompt_tokens", "reused_tokens", "recomputed_tokens",
                        "truly_new_tokens", "recomputed_per_new", "mean_ttft_ms", "worst_ttft_ms", "mean_decode_tps", "decode_drop")
            if any(k in r for r in runs)]
    lines.append("| run | " + " | ".join(keys) + " |")
    lines.append("|---|" + "---:|" * len(keys))
    for r in runs:
        lines.append(f"| {r['run']} | " + " | ".join(_cell(r.get(k)) for k in keys) + " |")
    lines += ["", "## Turns", "", "| " + " | ".join(TURN_COLUMNS) + " |", "|" + "---|" * len(TURN_COLUMNS)]
    for t in result.get("turns") or []:
        lines.append("| " + " | ".join(_cell(t.get(k)) for k in TURN_COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def _plots(out: Path, turns: list[dict[str, Any]]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs: dict[str, list[dict[str, Any]]] = {}
    for t in turns:
        runs.setdefault(str(t["run"]), []).append(t)
    written = []
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, ts in runs.items():
        pts = [(i, t["ttft_ms"] / 1000) for i, t in enumerate(ts) if t.get("ttft_ms") is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xlabel("request of the run")
    ax.set_ylabel("TTFT (s)")
    ax.set_title("time to first token per turn")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out / "ttft.png", dpi=100)
    plt.close(fig)
    written.append(out / "ttft.png")
    if any(t.get("recomputed_tokens") is not None for t in turns):
        fig, ax = plt.subplots(figsize=(max(6, len(turns) * 0.3), 4))
        x = list(range(len(turns)))
        rec = [t.get("recomputed_tokens") or 0 for t in turns]
        reu = [t.get("reused_tokens") or 0 for t in turns]
        ax.bar(x, reu, label="reused", color="tab:green")
        ax.bar(x, rec, bottom=reu, label="recomputed", color="tab:red")
        ax.set_xticks(x, [f"{t['run']}#{t['index']}" for t in turns], rotation=90, fontsize=6)
        ax.set_ylabel("prompt tokens")
        ax.set_title("reused vs recomputed tokens per turn")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "tokens.png", dpi=100)
        plt.close(fig)
        written.append(out / "tokens.png")
    return written


def write(out_dir: str | Path, result: dict[str, Any]) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "report.md").write_text(markdown(result))
    written = [out / "result.json", out / "report.md"]
    if any(t.get("ttft_ms") is not None for t in result.get("turns") or []):
        written += _plots(out, result["turns"])
    return written
