"""Where overlapped decode (engine/decode_pipeline.py) meets the host-issued fetch: the demo model
under a cap with room for 10 expert slots, three requests decoding together (widths 3, 2, 1), run
under several switch settings in one process; per setting the outcome (tokens or the error), the
staged passes, the tokens each request got before an error and the seconds taken. The eleventh GPU
session saw "the host-issued copies did not land within 5000 ms" at a layer task's first run here
in the serial engine (split, sampled: tokens [24, 23, 23], the first pass after the batch shrank
3 -> 2), not with one request (the capped engine tests). The twelfth session confirmed the cause:
"split, serial, no first-run settle" (the device step's first-run settle turned off) hung, every
other setting finished (docs/history/data/h200-2026-12-01-session12/results.md); the settle is no longer a
switch, and the fetch kernel the "kernel fetch" settings ran is retired (docs/gpu-tier.md).

Usage: python -m evals.gpu.overlap_probe [--only REGEX] [--timeout-s 60] [--device cpu (a dry run)]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from engine.engine import Engine
from engine.gpu.budget import dense_bytes, split_gpu_memory
from engine.options import EngineOptions
from engine.sampling import SamplingParams
from freetoken_agent.demo import write_demo_model

BASE = dict(device="cuda", dtype="float32", kv_tokens=2048, max_running=4, prefill_chunk=128)
SETTINGS = {  # name -> environment; the serial ones first: the eleventh session's failure was there
    "split, serial": {"FREETOKEN_OVERLAP_DECODE": "0"},
    "split, serial, greedy": {"FREETOKEN_OVERLAP_DECODE": "0", "GREEDY": "1"},
    "whole dma, serial": {"FREETOKEN_OVERLAP_DECODE": "0", "FREETOKEN_SPLIT_EXPERT": "0"},
    "split, overlap, one request": {"FREETOKEN_OVERLAP_DECODE": "1", "ONE": "1"},
    "split, overlap width 4": {"FREETOKEN_OVERLAP_DECODE": "1", "FREETOKEN_OVERLAP_WIDTH": "4"},
}
KNOBS = ("FREETOKEN_OVERLAP_DECODE", "FREETOKEN_OVERLAP_WIDTH", "FREETOKEN_SPLIT_EXPERT")


def cap_for(model: Path) -> int:
    if BASE["device"] != "cuda":
        return 0  # a dry run of the plumbing: no expert cache
    with Engine(model, EngineOptions(**BASE)) as ref:  # type: ignore[arg-type]
        w = ref.decoder.weights
        dense = dense_bytes(w) - w.embed.numel() * w.embed.element_size()
        banks = w.experts
        fixed = split_gpu_memory(2**40, ref.cfg, EngineOptions(**BASE), ref.dtype, dense, banks.expert_bytes)  # type: ignore[arg-type]
        return fixed.total - fixed.experts + 10 * banks.expert_bytes


def run(model: Path, cap: int, env: dict[str, str]) -> str:
    for k in KNOBS:
        os.environ.pop(k, None)
    os.environ.update({k: v for k, v in env.items() if k in KNOBS})
    prompt = list(range(300, 364))
    prompts = [prompt[:40], prompt[8:30], prompt[20:64]]
    greedy = env.get("GREEDY") == "1"
    params = [SamplingParams(max_tokens=24, ignore_eos=True),
              SamplingParams(max_tokens=32, temperature=0.0 if greedy else 0.8, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=28, temperature=0.0 if greedy else 1.0, top_p=0.9, seed=2, ignore_eos=True)]
    if env.get("ONE") == "1":
        prompts, params = prompts[:1], params[1:2]
    t0 = time.perf_counter()
    with Engine(model, EngineOptions.resolve({**BASE, "gpu_memory": cap, "fetch_ratio": 0.5})) as eng:
        handles = [eng.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]
        errors = []
        for h in handles:
            try:
                h.result(timeout=40)  # a setting that hangs costs 40 s, not the call
            except Exception as e:  # the outcome is what we print
                errors.append(f"{type(e).__name__}: {str(e)[:160]}")
        got = [len(h.output_ids) for h in handles]
        staged = eng.scheduler.staged_passes
        widths = sorted(eng.decoder.graphs)
        ex = eng.decoder.executor
        desc = ex.describe()
    took = time.perf_counter() - t0
    outcome = "OK" if not errors else "ERROR " + errors[0]
    return f"{outcome} | tokens {got} | staged {staged} | graph widths {widths} | {took:.1f} s | {desc[:120]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="")
    ap.add_argument("--timeout-s", type=float, default=60.0, help="per setting: a hang costs this, not the call")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the plumbing (no expert cache)")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)  # model dir, cap bytes, setting name
    args = ap.parse_args()
    BASE["device"] = args.device
    if args.child:
        model, cap, name = args.child
        print(f"RESULT {run(Path(model), int(cap), SETTINGS[name])}", flush=True)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = write_demo_model(Path(tmp) / "m", arch="qwen3_moe")
        cap = cap_for(model)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        for name, env in SETTINGS.items():
            if not re.search(args.only, name):
                continue
            cmd = [sys.executable, "-m", "evals.gpu.overlap_probe", "--device", args.device, "--child", str(model),
                   str(cap), name]
            try:
                proc = subprocess.run(cmd, env={**os.environ, **{k: v for k, v in env.items() if k in KNOBS}},
                                      capture_output=True, text=True, timeout=args.timeout_s)
                got = next((ln[7:] for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
                outcome = got or f"no result (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}"
            except subprocess.TimeoutExpired:
                outcome = f"TIMEOUT after {args.timeout_s:.0f} s (a hang)"
            print(f"{name}: {outcome}", flush=True)


if __name__ == "__main__":
    main()
