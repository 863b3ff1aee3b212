"""`freetoken-agent calibrate`: measure B_C (CPU expert executor) and B_P (pinned host->device
expert copies), alone and under contention, store them per machine and print them.

Contract: `add_calibrate_parser(sub)` registers the sub-command; `run_calibrate(args)` measures
(engine/gpu/calibrate.py), saves the record in `calibration_path()` (FREETOKEN_CACHE_DIR, else
the user cache dir, as the demo model uses) and prints it: a few lines of text, or with `--json`
one JSON object (the record, the fetch ratio the decode split takes from it, and the file it was
stored in). `--show` prints
the stored records without measuring. Without a CUDA device it still measures B_C, says that B_P
was not measured and stores the record with fetch ratio 0.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from freetoken_agent.argtypes import positive_int

if TYPE_CHECKING:
    from engine.gpu.calibration_store import Calibration

FILE_NAME = "calibration.json"


def calibration_path() -> Path:
    from freetoken_agent.demo import cache_root

    return cache_root() / FILE_NAME


# engine/quant/formats.py's FORMATS less bf16, spelled out: `--help` imports no torch (a test checks the two agree)
PACKED_FORMATS = ("fp8", "iq4_nl", "iq4_xs", "mxfp4", "nvfp4", "q2_k", "q3_k", "q4_0", "q4_1", "q4_k", "q5_0", "q5_1",
                  "q5_k", "q6_k", "q8_0")


def add_calibrate_parser(sub: argparse._SubParsersAction) -> None:
    from engine.weights.shapes import SHAPES

    p = sub.add_parser("calibrate", help="measure and store B_P (PCIe expert copies) and B_C (CPU experts)")
    p.add_argument("--threads", type=int, default=0, help="CPU executor threads (default: one per physical core)")
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES), help="expert shape (hidden, expert, top-k)")
    p.add_argument("--format", default="bf16", choices=["bf16", "f32", *PACKED_FORMATS],
                   help="expert weight format: bf16 / f32 float banks, or a packed format (GGUF types, fp8, mxfp4, "
                        "nvfp4: the packed executor on random valid blocks, the calibration a packed model looks up)")
    p.add_argument("--format-down", default="", choices=["", *PACKED_FORMATS],
                   help="packed: the down projection's format when it differs (a Q4_K_M file: q4_k / q6_k)")
    p.add_argument("--bank-gb", type=float, default=2.0, help="host bank of random experts, GB (default 2)")
    p.add_argument("--seconds", type=float, default=1.0, help="time per measurement per round")
    p.add_argument("--rounds", type=positive_int, default=3, help="rounds per measurement; the best is kept")
    p.add_argument("--show", action="store_true", help="print the stored records, measure nothing")
    p.add_argument("--json", action="store_true", help="print JSON")


def _ratios(cal: Calibration) -> dict[str, Any]:
    return {"ratio": cal.ratio()}


def _lines(cal: Calibration) -> list[str]:
    def gbps(v: float | None) -> str:
        return "not measured" if v is None else f"{v:.2f} GB/s"

    out = [f"machine: {cal.key.as_string()}  (measured {cal.measured_at})",
           f"  B_C  CPU experts alone:        {gbps(cal.b_cpu)}",
           f"  B_P  PCIe expert copies alone: {gbps(cal.b_pcie)}",
           f"  B_C' CPU experts, contended:   {gbps(cal.b_cpu_contended)}",
           f"  B_P' PCIe copies, contended:   {gbps(cal.b_pcie_contended)}",
           f"  fetch ratio q*/m: {cal.ratio():.3f}"]
    if cal.note:
        out.append(f"  note: {cal.note}")
    return out


def run_calibrate(args: argparse.Namespace) -> int:
    from engine.gpu.calibration_store import load_all, save

    path = calibration_path()
    if args.show:
        records = load_all(path)
        if args.json:
            print(json.dumps({"path": str(path), "machines": {k: {**v.to_json(), **_ratios(v)}
                                                              for k, v in records.items()}}))
        elif not records:
            print(f"no calibration stored in {path} (run `freetoken-agent calibrate`)")
        else:
            for cal in records.values():
                print("\n".join(_lines(cal)))
        return 0

    from engine.gpu.calibrate import CalibrationSpec, calibrate
    from engine.weights.shapes import SHAPES

    if args.threads < 0:
        raise ValueError(f"--threads must be >= 0, got {args.threads}")
    shape = SHAPES[args.shape]
    packed = args.format not in ("bf16", "f32")
    if args.format_down and not packed:
        raise ValueError(f"--format-down names a packed format's down projection; --format {args.format} is not packed")
    spec = CalibrationSpec(fmt=args.format, hidden=shape.hidden, inter=shape.inter, top_k=shape.top_k,
                           threads=args.threads, bank_bytes=int(args.bank_gb * 1e9), seconds=args.seconds,
                           rounds=args.rounds, packed=packed, fmt_down=args.format_down)
    from freetoken_agent.progress import load_progress

    with load_progress(f"measuring B_C and B_P ({args.rounds} rounds of {args.seconds:g} s per case)"):
        cal = calibrate(spec)
    save(path, cal)
    if args.json:
        print(json.dumps({**cal.to_json(), **_ratios(cal), "path": str(path)}))
    else:
        print("\n".join(_lines(cal)))
        print(f"stored in {path}")
    return 0
