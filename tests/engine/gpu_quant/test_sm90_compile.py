"""The packed-expert Triton kernels compile for the GPU machine's sm_90 on a machine without a GPU,
and ptxas keeps them in registers: engine/gpu/quant/gemv.py (decode) and grouped.py (streamed
prefill), and the candidate engine/gpu/quant/grouped_bf16.py, at Qwen3-30B-A3B's expert shape (H 2048,
I 768) for every packed format as both gate_up and down. CI has no GPU, so without this a kernel that
fails to lower (an op the interpreter accepts, a layout conversion Triton cannot make) or that spills
would first show on a device call. `triton.compile` with an explicit GPUTarget needs no driver; the
resource usage comes from the cubin (cuobjdump, shipped with Triton's NVIDIA backend). Compiled with
the Triton installed here, which may be newer than the GPU machine's."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

triton = pytest.importorskip("triton")
ASTSource = pytest.importorskip("triton.compiler").ASTSource
GPUTarget = pytest.importorskip("triton.backends.compiler").GPUTarget

HIDDEN, INTER = 2048, 768
FORMATS = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs",
           "mxfp4", "fp8", "nvfp4"]
TARGET = GPUTarget("cuda", 90, 32)


def _cuobjdump() -> Path:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        pytest.fail(f"{tool} is missing: Triton's NVIDIA backend ships it")
    return tool


def usage(cubin: bytes) -> dict[str, int]:
    """REG / STACK / SHARED / LOCAL of the cubin's one kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(_cuobjdump()), "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    found = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", out))
    assert set(found) >= {"REG", "STACK", "LOCAL"}, out
    return {k: int(v) for k, v in found.items()}


def compile_sm90(fn: Any, signature: dict[str, str], constexprs: dict[str, Any], warps: int,
                 stages: int = 3) -> dict[str, int]:
    full = {**signature, **{k: "constexpr" for k in constexprs}}
    kernel = triton.compile(ASTSource(fn, full, constexprs), target=TARGET,
                            options={"num_warps": warps, "num_stages": stages})
    return usage(kernel.asm["cubin"])


def layer(fmt: str) -> tuple[Any, Any, dict[str, Any]]:
    """The format's info, its row bytes as gate_up (K = HIDDEN) and as down (K = INTER), and the slot layout."""
    from engine.gpu.quant.formats import packed_format, row_bytes

    f = packed_format(fmt)
    gu_rb, d_rb = row_bytes(fmt, HIDDEN, "packed"), row_bytes(fmt, INTER, "packed")
    stride = (2 * INTER * gu_rb + HIDDEN * d_rb + 255) // 256 * 256
    return f, (gu_rb, d_rb), {"STRIDE": stride, "GU_OFF": 2 * INTER * gu_rb, "BSTRIDE": 3, "HAS_BIAS": False}


def grouped_kernels(fmt: str, module: Any, extra: Any) -> list[tuple[str, dict[str, int]]]:
    """(name, usage) of a grouped module's gate_up and down kernels, x bf16 and float32."""
    f, (gu_rb, d_rb), common = layer(fmt)
    common = {**common, "BLOCK_M": 64}
    ptrs = {"w_ptr": "*u8", "gs_ptr": "*fp32", "b_ptr": "*fp32", "row_entry_ptr": "*i64", "block_slot_ptr": "*i64"}
    out = []
    for xdt in ("bf16", "fp32"):
        sig = {"x_ptr": f"*{xdt}", **ptrs, "h_ptr": "*fp32", "K": "i32", "alpha": "fp32", "limit": "fp32"}
        cx = {"H": HIDDEN, "INTER": INTER, "ACT": 0, "FMT": f.code, "QB": f.block, "QBB": f.block_bytes, "RB": gu_rb,
              "BLOCK_K": module._GATE_UP_K, **common, **extra(f, xdt, "gate_up")}
        cx.setdefault("BLOCK_N", module._GATE_UP_N)
        out.append((f"gate_up x {xdt}", compile_sm90(module._gate_up_kernel, sig, cx, module._WARPS, module._STAGES)))
    sig = {"h_ptr": "*fp32", "w_ptr": "*u8", "gs_ptr": "*fp32", "b_ptr": "*fp32", "weight_ptr": "*fp32",
           "row_entry_ptr": "*i64", "block_slot_ptr": "*i64", "y_ptr": "*fp32"}
    cx = {"H": HIDDEN, "INTER": INTER, "FMT": f.code, "QB": f.block, "QBB": f.block_bytes, "RB": d_rb,
          "BLOCK_N": module._DOWN_N, "BLOCK_K": module._DOWN_K, **common, **extra(f, "fp32", "down")}
    out.append(("down", compile_sm90(module._down_kernel, sig, cx, module._WARPS, module._STAGES)))
    return out


def gemv_kernels(fmt: str) -> list[tuple[str, dict[str, int]]]:
    from engine.gpu.quant import gemv

    f, (gu_rb, d_rb), common = layer(fmt)
    common = {**common, "ROWS": gemv._ROWS, "COPIES": 1, "COPIES_P": 1, "NB": max(1, gemv._STEP // f.block),
              "PHASE": 0, "FMT": f.code, "QB": f.block, "QBB": f.block_bytes}
    ptrs = {"slot_ptr": "*i64", "w_ptr": "*u8", "gs_ptr": "*fp32", "b_ptr": "*fp32"}
    sig_gu = {"x_ptr": "*bf16", **ptrs, "gu_ptr": "*fp32", "dst_ptr": "*i64"}
    gu = compile_sm90(gemv._gate_up_kernel, sig_gu, {"H": HIDDEN, "INTER": INTER, "K": 8, "RB": gu_rb, **common}, 8)
    sig_d = {"gu_ptr": "*fp32", **ptrs, "wt_ptr": "*fp32", "y_ptr": "*fp32", "dst_ptr": "*i64", "alpha": "fp32",
             "limit": "fp32"}
    down = compile_sm90(gemv._down_kernel, sig_d, {"H": HIDDEN, "INTER": INTER, "ACT": 0, "RB": d_rb, **common}, 8)
    return [("gemv gate_up", gu), ("gemv down", down)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_kernels_compile_for_sm90_without_spills(fmt: str) -> None:
    from engine.gpu.quant import grouped
    from engine.gpu.quant import grouped_bf16 as candidate

    def none(f: Any, xdt: str, which: str) -> dict[str, Any]:
        return {"PRECISION": "tf32x3"}

    def bf16(f: Any, xdt: str, which: str) -> dict[str, Any]:
        pieces = {"bf16": 1, "fp16": 2, "fp32": 3}[xdt] if which == "gate_up" else 3
        cx = {"G": candidate.GROUP[f.code], "OFF": f.code in candidate.OFFSET, "NP": pieces}
        if which == "gate_up" and pieces > 1:  # bf16_packed_grouped_experts halves the tile for more pieces
            cx["BLOCK_N"] = candidate._GATE_UP_N // 2
        return cx

    results = gemv_kernels(fmt)
    results += [(f"grouped {n}", u) for n, u in grouped_kernels(fmt, grouped, none)]
    results += [(f"bf16 candidate {n}", u) for n, u in grouped_kernels(fmt, candidate, bf16)]
    spills = [(n, u) for n, u in results if u["STACK"] or u["LOCAL"]]
    assert not spills, f"{fmt}: kernels that spill on sm_90: {spills}"
    assert all(0 < u["REG"] <= 255 for _, u in results), results
