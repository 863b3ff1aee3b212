"""The GPU caps and llama.cpp -ncmoe values that leave the same share of experts resident as the
full model would have on a card of each cap (../shared/BENCHMARKS.md: a file with fewer layers than
the model is compared at the share the full model has).

Contract:
    python3 -m evals.gpu.cap_plan --model GGUF --caps 12GiB,24GiB [--full-layers N] [--overhead-gib 1.5]
        [--json PATH]
prints one line of `NCMOE:CAP` pairs (e.g. `20:8.47GiB 15:16.52GiB`), one per cap in order: CAP is the
--gpu-memory our engine gets on this file, NCMOE the `-ncmoe` llama.cpp gets. From the file's tensor
table (read from the header alone): E = a layer's expert bytes (every
`ffn_{gate,up,down,gate_up}_exps` tensor, weights and biases, as llama.cpp's -ncmoe pattern moves them),
D = the bytes llama.cpp keeps on the GPU with -ngl 99 besides experts (all but `token_embd` and the
experts), split into D0 outside the blocks and d per block. For a card of C bytes the full model
(--full-layers, default the file's) keeps r = clamp((C - overhead - D0 - full x d) / E, 0, full)
layers of experts resident: the share f = r / full. On the file's n layers llama.cpp keeps
round(f x n) layers' experts on the GPU (-ncmoe = n - that), and our engine gets
C - (full - n) x (d + f x E), the card less what the missing layers would have taken, so both keep
the share f. --overhead-gib is llama.cpp's GPU use beyond its weights (compute buffers, KV cache) in
that estimate. --json writes every figure. Exits non-zero on a file without expert tensors.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

GIB = float(1 << 30)
_EXPS = re.compile(r"\.ffn_(up|down|gate|gate_up)_(ch|)exps")
_BLK = re.compile(r"^blk\.(\d+)\.")


def parse_size(text: str) -> float:
    """'12GiB', '512MiB' or bytes -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*(GiB|MiB|)\s*", text)
    if m is None:
        raise ValueError(f"not a size: {text!r} (e.g. 12GiB)")
    return float(m.group(1)) * {"GiB": GIB, "MiB": float(1 << 20), "": 1.0}[m.group(2)]


_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes
_STRING, _ARRAY = 8, 9


def tensor_table(path: Path) -> list[tuple[str, int]]:
    """(name, bytes) of every tensor in a GGUF file, from its header alone (the gguf package's reader
    parses every metadata array element, tens of seconds for a 201088-token vocabulary; this skips them)."""
    import mmap
    import struct

    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF":
            raise SystemExit(f"cap_plan: {path} is not a GGUF file")
        n_tensors, n_kv = struct.unpack_from("<QQ", m, 8)
        at = 24

        def string() -> str:
            nonlocal at
            (n,) = struct.unpack_from("<Q", m, at)
            at += 8 + n
            return bytes(m[at - n:at]).decode("utf-8", errors="replace")

        def skip(vtype: int) -> None:
            nonlocal at
            if vtype == _STRING:
                (n,) = struct.unpack_from("<Q", m, at)
                at += 8 + n
            elif vtype == _ARRAY:
                etype, count = struct.unpack_from("<IQ", m, at)
                at += 12
                if etype in _SCALAR:
                    at += count * _SCALAR[etype]
                else:
                    for _ in range(count):
                        skip(etype)
            else:
                at += _SCALAR[vtype]

        for _ in range(n_kv):
            string()
            (vtype,) = struct.unpack_from("<I", m, at)
            at += 4
            skip(vtype)
        out = []
        for _ in range(n_tensors):
            name = string()
            (n_dims,) = struct.unpack_from("<I", m, at)
            dims = struct.unpack_from(f"<{n_dims}Q", m, at + 4)
            (ttype,) = struct.unpack_from("<I", m, at + 4 + 8 * n_dims)
            at += 4 + 8 * n_dims + 4 + 8
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
            numel = 1
            for d in dims:
                numel *= d
            out.append((name, numel // block * size))
    return out


def file_sizes(path: Path) -> dict[str, Any]:
    """{layers, expert_bytes: per layer, dense_outside, dense_per_layer} of a GGUF's tensor table."""
    experts: dict[int, int] = {}
    dense_out = dense_in = 0
    for name, n in tensor_table(path):
        m = _BLK.match(name)
        if m and _EXPS.search(name):
            experts[int(m.group(1))] = experts.get(int(m.group(1)), 0) + n
        elif name == "token_embd.weight":
            continue
        elif m:
            dense_in += n
        else:
            dense_out += n
    if not experts:
        raise SystemExit(f"cap_plan: {path} has no expert tensors")
    layers = 1 + max(experts)
    return {"layers": layers, "expert_bytes": [experts.get(i, 0) for i in range(layers)],
            "dense_outside": dense_out, "dense_per_layer": dense_in / layers}


def plan(sizes: dict[str, Any], cap: float, full_layers: int, overhead: float) -> dict[str, Any]:
    n = sizes["layers"]
    moe = [e for e in sizes["expert_bytes"] if e]
    per_layer = sum(moe) / len(moe)
    d = sizes["dense_per_layer"]
    resident = (cap - overhead - sizes["dense_outside"] - full_layers * d) / per_layer
    share = min(max(resident, 0.0), full_layers) / full_layers
    gpu_layers = min(round(share * n), n)
    ours = cap - (full_layers - n) * (d + share * per_layer)
    return {"cap_gib": cap / GIB, "share": share, "full_layers": full_layers, "file_layers": n,
            "peer_gpu_layers": gpu_layers, "ncmoe": n - gpu_layers, "ours_gib": round(ours / GIB, 2),
            "expert_layer_gib": per_layer / GIB, "dense_gib": (sizes["dense_outside"] + n * d) / GIB,
            "overhead_gib": overhead / GIB}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--caps", default="12GiB,24GiB", help="cards of the full model, comma-separated")
    p.add_argument("--full-layers", type=int, default=0, help="the full model's layers (default: the file's)")
    p.add_argument("--overhead-gib", type=float, default=1.5, help="llama.cpp's GPU use beyond weights")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    sizes = file_sizes(args.model)
    full = args.full_layers or sizes["layers"]
    if full < sizes["layers"]:
        p.error(f"--full-layers {full} is fewer than the file's {sizes['layers']}")
    rows = [plan(sizes, parse_size(c), full, args.overhead_gib * GIB) for c in args.caps.split(",") if c]
    if args.json is not None:
        args.json.write_text(json.dumps({"model": str(args.model), "plans": rows}, indent=1))
    print(" ".join(f"{r['ncmoe']}:{r['ours_gib']:.2f}GiB" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
