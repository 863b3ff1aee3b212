"""One markdown table of a side-by-side run (python -m evals.gpu.side_by_side DIR NCMOE:CAP ...).

Reads DIR/peer-bench.json (evals/peer/run_bench.py) and DIR/dec_ours_CAP.json / pre_ours_CAP.json
(`freetoken-agent bench ... --json`) as written by evals/gpu/run_side_by_side.sh, and prints, per
pair, decode tok/s of both with the ratio, our hit rate and measured / bound, TTFT per prompt length
of both with the ratio, and peak GPU memory of both. A missing file shows as "-".
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _ratio(ours: float | None, peer: float | None) -> str:
    return "-" if not ours or not peer else f"{ours / peer:.2f}x"


def rows(out: Path, pairs: list[str]) -> list[str]:
    peer_doc = _load(out / "peer-bench.json") or {}
    peers = {str(c.get("ncmoe")): c for c in peer_doc.get("configs", [])}
    lines = ["| cap (llama.cpp -ncmoe) | figure | freetoken-agent | llama.cpp | speed-up (ours / llama.cpp) | ours: bound, bound / measured |",
             "| --- | --- | --- | --- | --- | --- |"]
    for pair in pairs:
        ncmoe, cap = pair.split(":", 1)
        peer = peers.get(ncmoe, {})
        dec = _load(out / f"dec_ours_{cap}.json")
        pre = _load(out / f"pre_ours_{cap}.json")
        head = f"{cap} ({ncmoe})"
        first_decode: dict[str, Any] = next(iter(peer.get("decode", {}).values()), {})
        peer_tg = first_decode.get("tok_s")
        if dec:
            ours_tg = dec["tok_s"]
            # a generation of few distinct tokens routes to the same experts every step
            degenerate = " **degenerate generation: distinct tokens " \
                f"{dec['distinct_tokens']:.0%}, hit rate not representative**" if dec["distinct_tokens"] < 0.5 else ""
            lines.append(f"| {head} | decode tok/s, batch 1 | {ours_tg:.1f} (hit {dec['hit_rate']:.1%}, "
                         f"{dec['fetched_per_token']:.1f} fetched + {dec['cpu_misses_per_token']:.1f} CPU / token)"
                         f"{degenerate} | "
                         f"{_fmt(peer_tg)} | {_ratio(ours_tg, peer_tg)} | {_fmt(dec.get('bound_ms'))} ms, "
                         f"{_fmt(1 / dec['measured_over_bound'] if dec.get('measured_over_bound') else None, '.0%')} |")
        else:
            lines.append(f"| {head} | decode tok/s, batch 1 | - | {_fmt(peer_tg)} | - | - |")
        ours_runs = {str(r["prompt_tokens"]): r for r in (pre or {}).get("runs", [])}
        for n in sorted(set(ours_runs) | set(peer.get("prefill", {})), key=int):
            o = ours_runs.get(n, {})
            p_ttft = peer.get("prefill", {}).get(n, {}).get("ttft_s")
            o_ttft = o.get("ttft_s")
            bound = o.get("bound_s")
            share = bound / o_ttft if bound and o_ttft else None
            lines.append(f"| {head} | TTFT {n} tokens (s) | {_fmt(o_ttft, '.2f')} | {_fmt(p_ttft, '.2f')} | "
                         f"{_ratio(p_ttft, o_ttft)} | {_fmt(bound, '.2f')} s, {_fmt(share, '.0%')} |")
        ours_peak = [d["peak_gpu_bytes"] / 2**30 for d in (dec, pre) if d and d.get("peak_gpu_bytes")]
        peer_peak = peer.get("gpu_mem_peak_mib")
        lines.append(f"| {head} | peak GPU memory | {_fmt(max(ours_peak) if ours_peak else None, '.2f')} GiB | "
                     f"{_fmt(peer_peak / 1024 if peer_peak else None, '.2f')} GiB | | |".replace("- GiB", "-"))
    return lines


if __name__ == "__main__":
    print("\n".join(rows(Path(sys.argv[1]), sys.argv[2:])))
