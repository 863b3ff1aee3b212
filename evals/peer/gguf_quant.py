"""llama-quantize's per-tensor type choice, and random valid GGML blocks of a chosen spread.

Contract:
- `tensor_types(tensors, ftype, n_layer, n_expert)` -> {name: ggml type id}: the type llama.cpp's
  `llama-quantize` (commit 0c1e57098, `llama_tensor_get_type` in src/llama-quant.cpp) gives each tensor
  of a file quantized to `ftype` ("q8_0" = LLAMA_FTYPE_MOSTLY_Q8_0, "q4_k_m" = MOSTLY_Q4_K_M), with no
  imatrix, no overrides, an untied output matrix. `tensors` lists (name, numpy shape, source type)
  as in the source file; a tensor llama-quantize leaves alone (fewer than 2 dims, a name not ending
  in "weight", norms, the expert router `ffn_gate_inp`, `ssm_conv1d`) keeps its source type. The rules
  followed, for these two file types and the architectures write_gguf.py writes (qwen3moe,
  qwen35moe, qwen3next, deepseek2):
  - output.weight: Q6_K (Q8_0 for q8_0, and when its row length is not a multiple of 256);
  - token_embd.weight: the default type (Q4_K / Q8_0);
  - attn_v / attn_qkv / attn_kv_b (one counter over them, in llama.cpp's tensor order: layer, then
    name): Q6_K when `use_more_bits(i, n)` (q4_k_m), then Q8_0 whenever the model has exactly 8 experts;
  - attn_k: Q8_0 with exactly 8 experts; attn_output: Q5_K with exactly 8 experts (q4_k_m);
  - every `ffn_down*` (routed, shared, dense): Q6_K when `use_more_bits(layer, n_layer)` (q4_k_m);
  - all else the default type; then a row length that is not a multiple of the type's block falls
    back (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0; F16 when even that block does not divide it).
  use_more_bits(i, n) = i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2 (integer division).
- `fill_blocks(rng, qtype, n_blocks, std)` -> uint8 [n_blocks, block_bytes]: random blocks whose
  dequantized values have mean ~0 and standard deviation `std`, every f16 field finite. Built from
  random bytes with the scale fields set: Q8_0 / Q5_0 / Q6_K a fixed |d| with a random sign per block;
  Q4_K / Q5_K 6-bit sub-block scales uniform in 32..63 with each sub-block's min equal to its scale and
  dmin = d x (the mean quant), so each sub-block is centred; Q5_1 the min is -d x 15.5; MXFP4 (gpt-oss's
  experts, 32 e2m1 codes and one E8M0 exponent) uniform codes under the power of two nearest the
  wanted scale, so its std is `std` within a factor of 2^(1/2).
Pure numpy; `rng` is a numpy Generator, so values depend only on its seed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import numpy as np

F32, F16, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16, MXFP4 = 0, 1, 6, 7, 8, 12, 13, 14, 30, 39
TYPE_NAME = {F32: "F32", F16: "F16", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K",
             Q6_K: "Q6_K", BF16: "BF16", MXFP4: "MXFP4"}
# (values per block, bytes per block), as ggml's type traits
BLOCK = {F32: (1, 4), F16: (1, 2), BF16: (1, 2), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34), Q4_K: (256, 144),
         Q5_K: (256, 176), Q6_K: (256, 210), MXFP4: (32, 17)}
FTYPES = {"q8_0": (7, Q8_0), "q4_k_m": (15, Q4_K)}  # --quant -> (general.file_type, default tensor type)
MXFP4_MOE = 38  # LLAMA_FTYPE_MOSTLY_MXFP4_MOE: gpt-oss as released (its types are gguf_gptoss.tensor_types')
_FALLBACK = {Q4_K: Q5_0, Q5_K: Q5_1, Q6_K: Q8_0}
_LAYER = re.compile(r"^blk\.(\d+)\.")


def row_bytes(qtype: int, ncols: int) -> int:
    n, size = BLOCK[qtype]
    if ncols % n:
        raise ValueError(f"{ncols} columns are not whole {TYPE_NAME[qtype]} blocks of {n}")
    return ncols // n * size


def _category(name: str) -> str:
    """tensor_get_category: the first of these substrings the name holds (output / token_embd exactly)."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for key in ("attn_qkv.weight", "attn_kv_b.weight", "attn_v.weight", "attn_k.weight", "attn_q.weight",
                "attn_output.weight", "ffn_up", "ffn_gate", "ffn_down"):
        if key in name:
            return key
    return "other"


_ATTN_V = ("attn_qkv.weight", "attn_kv_b.weight", "attn_v.weight")
_KEEP = ("_norm.weight", "ffn_gate_inp.weight", "ssm_conv1d")


def _n_dims(shape: tuple[int, ...]) -> int:
    """ggml_n_dims of the tensor whose numpy shape this is (trailing ne of 1 do not count)."""
    ne = list(reversed(shape))
    while len(ne) > 1 and ne[-1] == 1:
        ne.pop()
    return len(ne)


def quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """tensor_allows_quantization, for the names these architectures have."""
    return (_n_dims(shape) >= 2 and name.endswith("weight") and not any(k in name for k in _KEEP))


def use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _llama_order(name: str) -> tuple[int, str]:
    """llama_model_loader's weight_name_comparer: layer number (-1 outside blocks), then name."""
    m = _LAYER.match(name)
    return (int(m.group(1)) if m else -1, name)


def _layer(name: str, n_layer: int) -> int:
    m = _LAYER.match(name)
    if m is None or not 0 <= int(m.group(1)) < n_layer:
        raise ValueError(f"cannot determine the layer of {name!r} (of {n_layer})")
    return int(m.group(1))


def tensor_types(tensors: Iterable[tuple[str, tuple[int, ...], int]], ftype: str, n_layer: int,
                 n_expert: int) -> dict[str, int]:
    if ftype not in FTYPES:
        raise ValueError(f"unknown file type {ftype!r} (known: {', '.join(FTYPES)})")
    if n_expert <= 1:
        raise ValueError("only MoE models (n_expert > 1): the ffn_down rule reads the layer from the name")
    default = FTYPES[ftype][1]
    q4km = ftype == "q4_k_m"
    ordered = sorted(tensors, key=lambda t: _llama_order(t[0]))
    n_attn_v = sum(_category(name) in _ATTN_V for name, _, _ in ordered)
    i_attn_v = 0
    out: dict[str, int] = {}
    for name, shape, src in ordered:
        if not quantizable(name, shape):
            out[name] = src
            continue
        cat, t = _category(name), default
        if cat == "output":
            t = Q8_0 if shape[-1] % BLOCK[default][0] else (Q6_K if default != Q8_0 else Q8_0)
        elif cat == "token_embd":
            pass
        elif cat in _ATTN_V:
            if q4km and use_more_bits(i_attn_v, n_attn_v):
                t = Q6_K
            if n_expert == 8:
                t = Q8_0
            i_attn_v += 1
        elif cat == "attn_k.weight":
            if n_expert == 8:
                t = Q8_0
        elif cat == "ffn_down":
            if q4km and use_more_bits(_layer(name, n_layer), n_layer):
                t = Q6_K
        elif cat == "attn_output.weight" and q4km and n_expert == 8:
            t = Q5_K
        out[name] = _fallback(t, shape[-1])
    return out


def _fallback(t: int, ncols: int) -> int:
    """tensor_type_fallback: a row length the type's block does not divide."""
    if ncols % BLOCK[t][0] == 0:
        return t
    t = _FALLBACK.get(t, t)
    return t if ncols % BLOCK[t][0] == 0 else F16


# ---------------------------------------------------------------- random blocks

_SC = np.arange(32, 64, dtype=np.float64)  # the 6-bit scales drawn (K types): uniform 32..63
_MS_SC = float(np.mean(_SC**2))


def _ms_uniform(lo: int, hi: int, centre: float) -> float:
    """Mean of (q - centre)^2 for q uniform over lo..hi."""
    q = np.arange(lo, hi + 1, dtype=np.float64)
    return float(np.mean((q - centre) ** 2))


# per type: the dequantized values' root mean square per unit of d
UNIT_RMS = {
    Q8_0: _ms_uniform(-128, 127, 0.0) ** 0.5,
    Q5_0: _ms_uniform(0, 31, 16.0) ** 0.5,
    Q5_1: _ms_uniform(0, 31, 15.5) ** 0.5,
    Q4_K: (_MS_SC * _ms_uniform(0, 15, 7.5)) ** 0.5,
    Q5_K: (_MS_SC * _ms_uniform(0, 31, 15.5)) ** 0.5,
    Q6_K: (_MS_SC * _ms_uniform(0, 63, 32.0)) ** 0.5,
    MXFP4: (274 / 8) ** 0.5,  # e2m1's 16 codes doubled (ggml's kvalues_mxfp4), per unit of 2^(e - 128)
}
# per type: byte offset of d, and of the second f16 (dmin / m) where there is one
_D_AT = {Q8_0: 0, Q5_0: 0, Q5_1: 0, Q4_K: 0, Q5_K: 0, Q6_K: 208}


def _f16_bits(x: float) -> int:
    v = np.float16(x)
    if not np.isfinite(v) or v == 0:
        raise ValueError(f"scale {x!r} does not fit a finite non-zero f16")
    return int(np.array(v).view(np.uint16))


def _e8m0(d: float) -> int:
    """The E8M0 byte whose scale 2^(e - 128) is nearest d (log2-wise)."""
    e = 128 + round(float(np.log2(d)))
    if not 1 <= e <= 254:
        raise ValueError(f"scale {d!r} does not fit an E8M0 exponent")
    return e


def _set_f16(b: np.ndarray, at: int, bits: int, random_sign: bool) -> None:
    """Write one f16 into column `at` of every block (little endian); its sign bit random when asked
    (taken from the random byte already there)."""
    b[:, at] = bits & 0xFF
    if random_sign:
        b[:, at + 1] = (bits >> 8) | (b[:, at + 1] & 0x80)
    else:
        b[:, at + 1] = bits >> 8


def _k_scales(b: np.ndarray, at: int) -> None:
    """The 12 bytes of 6-bit (scale, min) pairs at `at`: min = scale, every scale in 32..63."""
    a = b[:, at:at + 4] | 0xA0  # bit 5: scales 0-3 >= 32; bit 7: the high bits of scales 4-7 >= 32
    b[:, at:at + 4] = a
    b[:, at + 4:at + 8] = a
    lo = b[:, at + 8:at + 12] & 0x0F
    b[:, at + 8:at + 12] = lo | (lo << 4)


def fill_blocks(rng: np.random.Generator, qtype: int, n_blocks: int, std: float) -> np.ndarray:
    size = BLOCK[qtype][1]
    n_words = -(-n_blocks * size // 8)
    b = rng.bit_generator.random_raw(n_words).view(np.uint8)[: n_blocks * size].reshape(n_blocks, size)
    d = std / UNIT_RMS[qtype]
    if qtype == MXFP4:  # byte 0 the E8M0 scale e (the values are kvalues x 2^(e - 128)), then 16 bytes of codes
        b[:, 0] = _e8m0(d)
        return b
    at = _D_AT[qtype]
    if qtype in (Q8_0, Q5_0, Q6_K):
        _set_f16(b, at, _f16_bits(d), random_sign=True)
        if qtype == Q6_K:
            b[:, 192:208] = (b[:, 192:208] & 0x1F) | 0x20  # int8 scales 32..63
    elif qtype == Q5_1:
        _set_f16(b, 0, _f16_bits(d), random_sign=False)
        _set_f16(b, 2, _f16_bits(-15.5 * d), random_sign=False)
    else:  # Q4_K, Q5_K: value = d * sc * q - dmin * m with m = sc
        centre = 7.5 if qtype == Q4_K else 15.5
        _set_f16(b, 0, _f16_bits(d), random_sign=False)
        _set_f16(b, 2, _f16_bits(centre * d), random_sign=False)
        _k_scales(b, 4)
    return b
