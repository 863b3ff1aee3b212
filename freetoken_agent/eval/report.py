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
One eval run once per anchor policy (`--anchor-policy A,B`): `compare(results)` holds each
policy's own result (the schema above plus `anchor_policy`) under `policies` and one
`comparison_row` per policy (success count `succeeded` / `of`, summarise() over all its turns, its
own baseline and decode drop, and what its server said of its placement: checkpoints held at the
end, the anchor kinds of each session's last main plan); `markdown` of it is the comparison table followed by each policy's
usual tables, and `write` adds `ttft-POLICY.png` / `tokens-POLICY.png` per policy and
`policies.png` (TTFT per request, a line per policy; recomputed tokens per request, a bar per policy).
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
    if isinstance(v, dict):
        return ", ".join(f"{k} {n}" for k, n in v.items()) or "-"
    return str(v).replace("|", "/")


def markdown(result: dict[str, Any]) -> str:
    if result.get("policies"):
        return _comparison_markdown(result)
    return _markdown(result, f"freetoken-agent eval {result.get('eval', '')}", 1)


def _markdown(result: dict[str, Any], title: str, level: int) -> str:
    h = "#" * level
    lines = [f"{h} {title}", ""]
    for k in ("base_url", "model", "anchor_policy", "forced", "client", "baseline_decode_tps", "note"):
        if result.get(k) is not None:
            lines.append(f"- {k}: {result[k]}")
    lines += ["", f"{h}# Runs", ""]
    runs = result.get("runs") or []
    keys = [k for k in ("success", "requests", "failed", "prompt_tokens", "reused_tokens", "recomputed_tokens",
                        "truly_new_tokens", "recomputed_per_new", "mean_ttft_ms", "worst_ttft_ms", "mean_decode_tps", "decode_drop")
            if any(k in r for r in runs)]
    lines.append("| run | " + " | ".join(keys) + " |")
    lines.append("|---|" + "---:|" * len(keys))
    for r in runs:
        lines.append(f"| {r['run']} | " + " | ".join(_cell(r.get(k)) for k in keys) + " |")
    lines += ["", f"{h}# Turns", "", "| " + " | ".join(TURN_COLUMNS) + " |", "|" + "---|" * len(TURN_COLUMNS)]
    for t in result.get("turns") or []:
        lines.append("| " + " | ".join(_cell(t.get(k)) for k in TURN_COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def success_of(result: dict[str, Any]) -> tuple[int, int]:
    """(succeeded, out of) for one eval's result: replay its answered requests, swe its solved
    tasks, openclaw its turns that checked out."""
    if result.get("eval") == "openclaw":
        checks = result.get("checks") or []
        return sum(1 for c in checks if c.get("ok")), len(checks)
    if result.get("eval") == "replay":
        turns = result.get("turns") or []
        return sum(1 for t in turns if t.get("status") == 200), len(turns)
    runs = result.get("runs") or []
    return sum(1 for r in runs if r.get("success")), len(runs)


SUCCESS_NAMES = {"replay": "answered", "swe": "solved", "openclaw": "turns checked"}


def comparison_row(result: dict[str, Any]) -> dict[str, Any]:
    """One policy's line of the comparison: its whole workload summarised over every turn, the
    success count, and the decode drop against its own server's baseline."""
    done, of = success_of(result)
    row = {"anchor_policy": result.get("anchor_policy"), "server_anchor_policy": result.get("server_anchor_policy"),
           "succeeded": done, "of": of, "runs": len(result.get("runs") or []), **summarise(result.get("turns") or []),
           "baseline_decode_tps": result.get("baseline_decode_tps"),
           "server_checkpoints": result.get("server_checkpoints"),
           "server_anchor_kinds": result.get("server_anchor_kinds")}
    base, mean = row["baseline_decode_tps"], row["mean_decode_tps"]
    row["decode_drop"] = round(1 - mean / base, 3) if mean is not None and base else None
    return row


COMPARISON_COLUMNS = (("requests", "requests"), ("failed", "failed"), ("prompt_tokens", "prompt"),
                      ("reused_tokens", "reused"), ("recomputed_tokens", "recomputed"),
                      ("truly_new_tokens", "truly new"), ("recomputed_per_new", "recomputed / new"),
                      ("mean_ttft_ms", "mean TTFT (ms)"), ("worst_ttft_ms", "worst TTFT (ms)"),
                      ("mean_decode_tps", "mean decode tok/s"), ("baseline_decode_tps", "baseline tok/s"),
                      ("decode_drop", "decode drop"), ("server_checkpoints", "checkpoints held"),
                      ("server_anchor_kinds", "anchors of the last main plans"))


def _comparison_markdown(result: dict[str, Any]) -> str:
    name = result.get("eval", "")
    lines = [f"# freetoken-agent eval {name}: anchor policies {', '.join(result.get('anchor_policies') or [])}", ""]
    for k in ("model", "client", "forced", "note"):
        if result.get(k) is not None:
            lines.append(f"- {k}: {result[k]}")
    lines += ["- each policy ran the whole workload on a fresh `freetoken-agent serve --anchor-policy P`",
              "", "## Comparison", ""]
    lines.append("| anchor policy | server's policy | " + SUCCESS_NAMES.get(str(name), "success") + " | "
                 + " | ".join(title for _, title in COMPARISON_COLUMNS) + " |")
    lines.append("|---|---|---:|" + "---:|" * (len(COMPARISON_COLUMNS) - 1) + "---|")
    for row in result.get("comparison") or []:
        lines.append(f"| {row['anchor_policy']} | {_cell(row.get('server_anchor_policy'))} | "
                     f"{row['succeeded']}/{row['of']} | " + " | ".join(_cell(row.get(k)) for k, _ in COMPARISON_COLUMNS)
                     + " |")
    text = "\n".join(lines) + "\n"
    for r in result["policies"]:
        text += "\n" + _markdown(r, f"anchor policy {r.get('anchor_policy')}", 2)
    return text


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plots(out: Path, turns: list[dict[str, Any]], suffix: str = "") -> list[Path]:
    plt = _pyplot()

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
    fig.savefig(out / f"ttft{suffix}.png", dpi=100)
    plt.close(fig)
    written.append(out / f"ttft{suffix}.png")
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
        fig.savefig(out / f"tokens{suffix}.png", dpi=100)
        plt.close(fig)
        written.append(out / f"tokens{suffix}.png")
    return written


def _comparison_plot(out: Path, results: list[dict[str, Any]]) -> Path:
    """`policies.png`: above, TTFT per request of the workload, one line per policy; below,
    recomputed tokens per request, one bar per policy in each request's group."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    n = max((len(r.get("turns") or []) for r in results), default=0)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8, n * 0.25 * max(1, len(results))), 7), sharex=True)
    width = 0.8 / max(1, len(results))
    for k, r in enumerate(results):
        name = str(r.get("anchor_policy"))
        turns = r.get("turns") or []
        pts = [(i, t["ttft_ms"] / 1000) for i, t in enumerate(turns) if t.get("ttft_ms") is not None]
        if pts:
            top.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        x = [i - 0.4 + width * (k + 0.5) for i in range(len(turns))]
        bottom.bar(x, [t.get("recomputed_tokens") or 0 for t in turns], width=width, label=name)
    top.set_ylabel("TTFT (s)")
    top.set_title("time to first token per request, by anchor policy")
    top.grid(alpha=0.3)
    top.legend(fontsize="small")
    bottom.set_ylabel("recomputed tokens")
    bottom.set_xlabel("request of the workload")
    bottom.set_title("recomputed prompt tokens per request, by anchor policy")
    bottom.grid(alpha=0.3, axis="y")
    bottom.legend(fontsize="small")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(out / "policies.png", dpi=100)
    plt.close(fig)
    return out / "policies.png"


def write(out_dir: str | Path, result: dict[str, Any]) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "report.md").write_text(markdown(result))
    written = [out / "result.json", out / "report.md"]
    if result.get("policies"):
        for r in result["policies"]:
            if any(t.get("ttft_ms") is not None for t in r.get("turns") or []):
                written += _plots(out, r["turns"], f"-{r.get('anchor_policy')}")
        written.append(_comparison_plot(out, result["policies"]))
    elif any(t.get("ttft_ms") is not None for t in result.get("turns") or []):
        written += _plots(out, result["turns"])
    return written


def compare(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The result of one eval run once per anchor policy: each policy's own result (its
    `anchor_policy` set) under `policies`, in order, and their `comparison` rows."""
    first = results[0]
    return {"eval": first.get("eval"), "anchor_policies": [r.get("anchor_policy") for r in results],
            "model": first.get("model"), "client": first.get("client"), "forced": first.get("forced"),
            "comparison": [comparison_row(r) for r in results], "policies": results}
