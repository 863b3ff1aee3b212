#!/usr/bin/env python3
"""Write a qwen3moe, qwen35moe, qwen3next, deepseek2 or gpt-oss GGUF with random weights, for the llama.cpp peer benchmark.

Contract:
    python3 evals/peer/write_gguf.py --out PATH [--arch qwen3moe|qwen35moe|qwen3next|deepseek2|gpt-oss --layers N
        --experts 128 --top-k 8 --hidden 2048 --inter 768 --heads 32 --kv-heads 4 --head-dim 128
        --vocab-from VOCAB.gguf --seed 0 --dtype bf16 --quant bf16|q8_0|q4_k_m|mxfp4 --threads N --max-gib G]
        qwen35moe only: [--shared-inter 512 --full-attn-interval 4 --linear-key-heads 16
        --linear-value-heads 32 --linear-head-dim 128 --conv-kernel 4 --rope-dim 64
        --rope-sections 11,11,10,0]; qwen3next the same but --rope-sections
        deepseek2 only: [--ff 10240 --q-lora 768 --kv-lora 512 --qk-nope 192 --qk-rope 64 --v-head 256
        --first-dense 1 --shared-experts 1 --routed-scale 1.8]
        gpt-oss only: [--sliding-window 128 --yarn-factor 32 --yarn-orig-ctx 4096]

- --arch qwen3moe (the default): Qwen3-30B-A3B's per-layer shape with 24 layers instead of 48 (the
  GPU machine's disk holds that file: 27 GiB (29 GB) of experts, 29 GiB (31 GB) in all).
- --arch qwen35moe (llama.cpp's name for Qwen3.5/3.6-MoE): Qwen3.6-35B-A3B's per-layer shape
  (256 experts top-8 of 512, a shared expert of 512 with a sigmoid gate, hidden 2048; every 4th
  layer full attention: 16 q heads / 2 kv heads of 256, gated q, partial rotary 64 of 256 dims,
  IMRoPE sections 11,11,10,0, theta 1e7; the others Gated DeltaNet: 16 key heads, 32 value heads of
  128, conv kernel 4) with 20 layers instead of 40 (5 full attention + 15 Gated DeltaNet: 30 GiB of
  experts, 32 GiB in all). --layers must be a multiple of --full-attn-interval. Tensor names,
  shapes and keys are those llama.cpp's loader reads (src/models/qwen35moe.cpp of the peer's commit);
  no MTP layer.
- --arch qwen3next (Qwen3-Next-80B-A3B, all 48 layers: 512 experts top-10, otherwise qwen35moe's
  layer): as qwen35moe but with one `ssm_ba` [2 x value heads, hidden] instead of ssm_beta and
  ssm_alpha, NEOX partial rotary (no rope.dimension_sections) (src/models/qwen3next.cpp).
- --arch deepseek2 (MLA; GLM-4.7-Flash's shape, all 47 layers, which llama.cpp runs as deepseek2):
  evals/peer/gguf_mla.py.
- --arch gpt-oss (gpt-oss-120b's shape, all 36 layers by default: 59 GiB, 57 GiB of MXFP4 experts, more
  than the GPU machine's disk holds: --layers or --max-gib): the types of the released MXFP4 files
  (MXFP4 experts, Q8_0 attention / embedding / output, F32 router, norms, biases and sinks; --quant
  mxfp4, its only one) and, unless --vocab-from is given, the o200k_harmony tokenizer and harmony
  chat template built from the bpe-openai package: evals/peer/gguf_gptoss.py. --rms-eps defaults to
  its 1e-5 (the others' 1e-6).
- --max-gib G: the largest layer count up to --layers whose file is at most G GiB (a multiple of
  --full-attn-interval for the hybrids, even for gpt-oss; printed, and the file's block_count and
  OUT.args.json say it), so a caller can fill a disk without computing sizes.
- Matrices are normal(0, std) drawn in float32 and truncated to bf16 (or rounded to f16 with
  --dtype f16); the routers (ffn_gate_inp) are float32 normal(0, --std); every norm weight is 1.0.
  --scales residual (the default): std is --std except for the token embedding (1.0) and the
  matrices that write into the residual stream (attn_output, ssm_out, ffn_down_exps,
  ffn_down_shexp: --std / sqrt(2 x layers)), as the engine's own random weights
  (engine/weights/dummy.py): each token keeps its identity through the layers and the random
  routers route near-uniformly, so both engines decode the same bytes under a real cache test.
  --scales uniform (the files of the H200 sessions up to the fifth): --std everywhere, where every
  position collapses onto one direction and each layer routes every token to the same experts (our
  decode on it hit 98 % of its experts, fifth session).
  qwen35moe: the shared-expert gate vector (ffn_gate_inp_shexp) and the Gated DeltaNet conv kernel
  (ssm_conv1d, which ggml's ssm_conv wants in float32) are float32 normal(0, --std); ssm_a (llama.cpp
  stores -exp(A_log)) is -1.0 (A_log = 0) and ssm_dt.bias is 0, so each step's decay is
  exp(-softplus(alpha)), in (0, 1): activations stay finite.
  Values depend only on --seed, the tensor's name and its shape (never on --threads), so two runs
  with the same arguments write byte-identical files.
- --quant bf16 (the default): matrices in --dtype as above. --quant q8_0 / q4_k_m: the file
  llama.cpp's `llama-quantize` would make of the bf16 one with that type (LLAMA_FTYPE_MOSTLY_Q8_0 /
  MOSTLY_Q4_K_M): each tensor in the type it would choose (evals/peer/gguf_quant.py: Q4_K, Q6_K for
  output.weight and for attn_v / attn_qkv / ffn_down* on its use_more_bits layers, Q8_0 / Q5_K with
  exactly 8 experts, Q5_0 / Q5_1 / Q8_0 / F16 where a row is not whole blocks; norms, routers,
  ssm_conv1d and 1-D tensors stay float32), its bytes written directly as random valid blocks
  (no float weights, no quantizer) whose dequantized values have mean ~0 and the std the bf16 file's
  tensor has (--scales). evals/peer/requantize.sh makes the Q4_K_M file with llama-quantize itself
  (from a --quant q8_0 source); tests/engine/test_peer_requantize.py checks this type map against it.
- The tokenizer (every tokenizer.* key) is copied from --vocab-from, by default llama.cpp's
  models/ggml-vocab-qwen2.gguf (Qwen2/Qwen3's 151936-token BPE vocabulary); the embedding and
  output matrices take its vocabulary size.
- Writes streaming: header, key/values and tensor infos first, then the data tensor by tensor
  (at most two tensors in memory: one being generated by --threads workers, one being written),
  into OUT.part, renamed to OUT at the end, with OUT.args.json beside it: a later call with the same
  arguments finds that and leaves the file alone (--force rewrites). Fails before writing when the
  destination's disk lacks the room. Prints throughput.
- Needs numpy and the `gguf` package (which imports pyyaml); when `import gguf` fails it imports the
  gguf wheel (and a PyYAML wheel, if one is there) found in --wheels (default: the repository's
  .whl/, filled by fetch_source.sh) straight from the zip files, so nothing has to be installed on
  a machine without network.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import shutil
import sys
import tarfile
import tempfile
import threading
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gguf_gptoss as go
import gguf_mla as gm  # sibling modules (this file also runs as a script)
import gguf_quant as gq

REPO = Path(__file__).resolve().parents[2]
CHUNK = 1 << 22  # elements per random-number chunk (and per worker task); fixed so output is thread-independent
QCHUNK = 1 << 15  # quantized blocks per chunk, likewise
GIB = float(1 << 30)
FILE_TYPE = {"bf16": 32, "f16": 1}  # llama_ftype: MOSTLY_BF16, MOSTLY_F16


def import_gguf(wheels: Path) -> ModuleType:
    """`import gguf`, falling back to the wheels in `wheels` (zip imports; pure python)."""
    try:
        import gguf
    except ImportError:
        found = sorted(glob.glob(str(wheels / "gguf-*.whl"))) + sorted(
            glob.glob(str(wheels / "[Pp][Yy][Yy][Aa][Mm][Ll]-*.whl"))
        )
        if not found:
            raise SystemExit(f"write_gguf.py: the gguf package is not importable and {wheels} has no gguf wheel") from None
        for whl in found:
            if whl not in sys.path:
                sys.path.insert(0, whl)
        for name in [m for m in sys.modules if m == "gguf" or m.startswith("gguf.") or m == "yaml"]:
            del sys.modules[name]
        import gguf
    return gguf


@dataclass(frozen=True)
class Shape:
    layers: int
    experts: int
    top_k: int
    hidden: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    # qwen35moe only (0 for qwen3moe)
    shared_inter: int = 0  # the shared expert's intermediate size
    full_attn_interval: int = 1  # layer i is full attention when (i + 1) % interval == 0, else Gated DeltaNet
    linear_key_heads: int = 0  # Gated DeltaNet: ssm.group_count
    linear_value_heads: int = 0  # ssm.time_step_rank
    linear_head_dim: int = 0  # key and value head dim: ssm.state_size
    conv_kernel: int = 0  # ssm.conv_kernel

    def is_full_attention(self, layer: int) -> bool:
        return (layer + 1) % self.full_attn_interval == 0


F32_RANDOM = ("router", "vec")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # numpy (row-major) order: the reverse of ggml's ne
    # "mat": random in the file dtype; "router" / "vec": random float32; "norm": float32 ones;
    # "const": float32 filled with `fill`
    kind: str
    fill: float = 0.0
    role: str = ""  # "embed" or "residual" (writes into the residual stream): their own std (--scales)

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape))

    def nbytes(self, dtype: str, qtype: int | None = None) -> int:
        """Bytes in the file: 2 per element for matrices (bf16 or f16), 4 for every float32 tensor; in
        `qtype` (a ggml type id of gguf_quant) when given."""
        if qtype is not None:
            return self.numel // self.shape[-1] * gq.row_bytes(qtype, self.shape[-1])
        return self.numel * (2 if self.kind == "mat" else 4)


def _head_specs(s: Shape) -> list[TensorSpec]:
    """The embedding, final norm and untied output matrix (both architectures, in this order)."""
    return [
        TensorSpec("token_embd.weight", (s.vocab, s.hidden), "mat", role="embed"),
        TensorSpec("output_norm.weight", (s.hidden,), "norm"),
        TensorSpec("output.weight", (s.vocab, s.hidden), "mat"),
    ]


def _routed_specs(b: str, s: Shape) -> list[TensorSpec]:
    """A block's router and routed expert banks (separate gate and up), in this order."""
    return [
        TensorSpec(b + "ffn_gate_inp.weight", (s.experts, s.hidden), "router"),
        TensorSpec(b + "ffn_gate_exps.weight", (s.experts, s.inter, s.hidden), "mat"),
        TensorSpec(b + "ffn_up_exps.weight", (s.experts, s.inter, s.hidden), "mat"),
        TensorSpec(b + "ffn_down_exps.weight", (s.experts, s.hidden, s.inter), "mat", role="residual"),
    ]


def tensor_specs(s: Shape) -> list[TensorSpec]:
    """Every tensor llama.cpp's qwen3moe loader asks for (untied output matrix, separate q/k/v)."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    specs = _head_specs(s)
    for i in range(s.layers):
        b = f"blk.{i}."
        specs += [
            TensorSpec(b + "attn_norm.weight", (s.hidden,), "norm"),
            TensorSpec(b + "attn_q.weight", (q, s.hidden), "mat"),
            TensorSpec(b + "attn_k.weight", (kv, s.hidden), "mat"),
            TensorSpec(b + "attn_v.weight", (kv, s.hidden), "mat"),
            TensorSpec(b + "attn_output.weight", (s.hidden, q), "mat", role="residual"),
            TensorSpec(b + "attn_q_norm.weight", (s.head_dim,), "norm"),
            TensorSpec(b + "attn_k_norm.weight", (s.head_dim,), "norm"),
            TensorSpec(b + "ffn_norm.weight", (s.hidden,), "norm"),
            *_routed_specs(b, s),
        ]
    return specs


def qwen35moe_tensor_specs(s: Shape, fused_ba: bool = False) -> list[TensorSpec]:
    """Every tensor llama.cpp's qwen35moe loader asks for (load_arch_tensors in src/models/qwen35moe.cpp),
    shapes in numpy order (the reverse of the loader's ne): untied output, separate q (query and gate
    interleaved per head, hence 2x) / k / v in full-attention layers, fused qkv plus a z gate in
    Gated DeltaNet layers, separate gate and up expert banks, the shared expert and its gate.
    `fused_ba`: qwen3next's instead (src/models/qwen3next.cpp), the same but for one `ssm_ba`
    [2 x value heads, hidden] (per key head: its value heads' beta rows, then their alpha rows) in
    place of ssm_beta and ssm_alpha."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    key_dim = s.linear_key_heads * s.linear_head_dim
    value_dim = s.linear_value_heads * s.linear_head_dim
    conv_dim = 2 * key_dim + value_dim
    specs = _head_specs(s)
    for i in range(s.layers):
        b = f"blk.{i}."
        specs += [
            TensorSpec(b + "attn_norm.weight", (s.hidden,), "norm"),
            TensorSpec(b + "post_attention_norm.weight", (s.hidden,), "norm"),
        ]
        if s.is_full_attention(i):
            specs += [
                TensorSpec(b + "attn_q.weight", (2 * q, s.hidden), "mat"),
                TensorSpec(b + "attn_k.weight", (kv, s.hidden), "mat"),
                TensorSpec(b + "attn_v.weight", (kv, s.hidden), "mat"),
                TensorSpec(b + "attn_output.weight", (s.hidden, q), "mat", role="residual"),
                TensorSpec(b + "attn_q_norm.weight", (s.head_dim,), "norm"),
                TensorSpec(b + "attn_k_norm.weight", (s.head_dim,), "norm"),
            ]
        else:
            specs += [
                TensorSpec(b + "attn_qkv.weight", (conv_dim, s.hidden), "mat"),
                TensorSpec(b + "attn_gate.weight", (value_dim, s.hidden), "mat"),
                TensorSpec(b + "ssm_conv1d.weight", (conv_dim, s.conv_kernel), "vec"),
                TensorSpec(b + "ssm_dt.bias", (s.linear_value_heads,), "const", 0.0),
                TensorSpec(b + "ssm_a", (s.linear_value_heads,), "const", -1.0),  # -exp(A_log), A_log = 0
                *([TensorSpec(b + "ssm_ba.weight", (2 * s.linear_value_heads, s.hidden), "mat")] if fused_ba else [
                    TensorSpec(b + "ssm_beta.weight", (s.linear_value_heads, s.hidden), "mat"),
                    TensorSpec(b + "ssm_alpha.weight", (s.linear_value_heads, s.hidden), "mat")]),
                TensorSpec(b + "ssm_norm.weight", (s.linear_head_dim,), "norm"),
                TensorSpec(b + "ssm_out.weight", (s.hidden, value_dim), "mat", role="residual"),
            ]
        specs += [
            *_routed_specs(b, s),
            TensorSpec(b + "ffn_gate_inp_shexp.weight", (s.hidden,), "vec"),
            TensorSpec(b + "ffn_gate_shexp.weight", (s.shared_inter, s.hidden), "mat"),
            TensorSpec(b + "ffn_up_shexp.weight", (s.shared_inter, s.hidden), "mat"),
            TensorSpec(b + "ffn_down_shexp.weight", (s.hidden, s.shared_inter), "mat", role="residual"),
        ]
    return specs


def fill_chunk(out: np.ndarray, spec: TensorSpec, seed: int, index: int, std: float, dtype: str) -> None:
    """Fill out[index*CHUNK : ...] (a flat view) with this chunk's deterministic random values."""
    lo = index * CHUNK
    hi = min(lo + CHUNK, out.size)
    rng = _chunk_rng(spec, seed, index)
    tmp = rng.standard_normal(hi - lo, dtype=np.float32)
    tmp *= np.float32(std)
    if spec.kind in F32_RANDOM:
        out[lo:hi] = tmp
    elif dtype == "bf16":
        out[lo:hi] = tmp.view(np.uint16)[1::2]  # the high half of each little-endian float32: truncated bf16
    else:
        out[lo:hi] = tmp.astype(np.float16)


def _chunk_rng(spec: TensorSpec, seed: int, index: int) -> np.random.Generator:
    key = (zlib.crc32(spec.name.encode()), index)
    return np.random.Generator(np.random.SFC64(np.random.SeedSequence(seed, spawn_key=key)))


def fill_quant_chunk(out: np.ndarray, spec: TensorSpec, seed: int, index: int, std: float, qtype: int) -> None:
    """Fill blocks [index*QCHUNK, ...) of out (uint8 [blocks, block_bytes]) with random valid blocks."""
    lo = index * QCHUNK
    hi = min(lo + QCHUNK, out.shape[0])
    out[lo:hi] = gq.fill_blocks(_chunk_rng(spec, seed, index), qtype, hi - lo, std)


def make_quant_tensor(pool: ThreadPoolExecutor, spec: TensorSpec, seed: int, std: float, qtype: int) -> np.ndarray:
    """A matrix as `qtype` blocks: uint8 [*shape[:-1], row bytes]."""
    n_blocks = spec.numel // gq.BLOCK[qtype][0]
    arr = np.empty((n_blocks, gq.BLOCK[qtype][1]), dtype=np.uint8)
    futures = [pool.submit(fill_quant_chunk, arr, spec, seed, c, std, qtype) for c in range(-(-n_blocks // QCHUNK))]
    for f in futures:
        f.result()
    return arr.reshape(*spec.shape[:-1], gq.row_bytes(qtype, spec.shape[-1]))


def make_tensor(pool: ThreadPoolExecutor, spec: TensorSpec, seed: int, std: float, dtype: str,
                qtype: int | None = None) -> np.ndarray:
    if qtype is not None and qtype in gq.UNIT_RMS:
        return make_quant_tensor(pool, spec, seed, std, qtype)
    if qtype == gq.F16:  # a matrix whose rows are not whole blocks (llama-quantize's last fallback)
        dtype = "f16"
    if spec.kind == "norm":
        return np.ones(spec.shape, dtype=np.float32)
    if spec.kind == "const":
        return np.full(spec.shape, spec.fill, dtype=np.float32)
    np_dtype: Any = np.float32 if spec.kind in F32_RANDOM else (np.uint16 if dtype == "bf16" else np.float16)
    arr = np.empty(spec.numel, dtype=np_dtype)
    n_chunks = (spec.numel + CHUNK - 1) // CHUNK
    for f in [pool.submit(fill_chunk, arr, spec, seed, c, std, dtype) for c in range(n_chunks)]:
        f.result()
    return arr.reshape(spec.shape)


def copy_tokenizer(gguf: ModuleType, writer: Any, vocab_path: Path) -> int:
    """Copy every tokenizer.* key of vocab_path into writer; returns the vocabulary size."""
    reader = gguf.GGUFReader(str(vocab_path))
    n_vocab = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        writer.add_key_value(key, value, vtype, sub_type)
        if key == "tokenizer.ggml.tokens":
            n_vocab = len(value)
    if n_vocab == 0:
        raise SystemExit(f"write_gguf.py: {vocab_path} has no tokenizer.ggml.tokens")
    return n_vocab


# Per-architecture defaults of the options that default to None. qwen3moe: Qwen3-30B-A3B with 24 of
# its 48 layers; qwen35moe: Qwen3.6-35B-A3B (engine/weights/shapes.py) with 20 of its 40 layers.
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3moe": dict(layers=24, experts=128, top_k=8, hidden=2048, inter=768, heads=32, kv_heads=4,
                     head_dim=128, ff=6144, ctx=40960, rope_base=1e6),
    "qwen35moe": dict(layers=20, experts=256, top_k=8, hidden=2048, inter=512, heads=16, kv_heads=2,
                      head_dim=256, ctx=262144, rope_base=1e7, shared_inter=512, full_attn_interval=4,
                      linear_key_heads=16, linear_value_heads=32, linear_head_dim=128, conv_kernel=4),
}
QWEN35_ONLY = ("shared_inter", "full_attn_interval", "linear_key_heads", "linear_value_heads", "linear_head_dim",
               "conv_kernel", "rope_dim", "rope_sections")
# Qwen3-Next-80B-A3B (engine/weights/shapes.py): the Qwen3.5 hybrid's layer with 512 experts top-10,
# all 48 layers; NEOX partial rotary (no IMRoPE sections)
ARCH_DEFAULTS["qwen3next"] = {**ARCH_DEFAULTS["qwen35moe"], "layers": 48, "experts": 512, "top_k": 10}
ARCH_DEFAULTS["deepseek2"] = dict(gm.GLM_FLASH)
ARCH_DEFAULTS["gpt-oss"] = dict(go.GPT_OSS_120B)
# the options each architecture takes beyond the common ones
ARCH_ONLY: dict[str, tuple[str, ...]] = {"qwen3moe": ("ff",), "qwen35moe": QWEN35_ONLY,
                                         "qwen3next": QWEN35_ONLY[:-1], "deepseek2": ("ff", *gm.OPTIONS),
                                         "gpt-oss": go.OPTIONS}
HYBRIDS = ("qwen35moe", "qwen3next")
PARTIAL_ROTARY = 0.25  # Qwen3.5/3.6's partial_rotary_factor: rope.dimension_count = head_dim / 4


def mrope_sections(rope_dim: int) -> list[int]:
    """IMRoPE sections (t, h, w, e) over rope_dim / 2 rotary pairs, split as Qwen3.5's mrope_section
    [11, 11, 10] splits 32: t = ceil(half / 3), h = ceil((half - t) / 2), w = the rest, e = 0."""
    half = rope_dim // 2
    t = -(-half // 3)
    h = -(-(half - t) // 2)
    return [t, h, half - t - h, 0]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="the GGUF file to write")
    p.add_argument("--arch", choices=sorted(ARCH_DEFAULTS), default="qwen3moe",
                   help="qwen3moe (Qwen3-MoE), qwen35moe (Qwen3.5/3.6-MoE, Gated DeltaNet 3:1 hybrid), qwen3next "
                        "(Qwen3-Next), deepseek2 (MLA; GLM-4.7-Flash's shape) or gpt-oss (gpt-oss-120b's shape)")
    p.add_argument("--layers", type=int, default=None, help="qwen3moe 24, qwen35moe 20")
    p.add_argument("--experts", type=int, default=None, help="qwen3moe 128, qwen35moe 256")
    p.add_argument("--top-k", type=int, default=None, help="experts used per token (8)")
    p.add_argument("--hidden", type=int, default=None, help="2048")
    p.add_argument("--inter", type=int, default=None, help="expert intermediate size (qwen3moe 768, qwen35moe 512)")
    p.add_argument("--heads", type=int, default=None, help="full-attention query heads (qwen3moe 32, qwen35moe 16)")
    p.add_argument("--kv-heads", type=int, default=None, help="qwen3moe 4, qwen35moe 2")
    p.add_argument("--head-dim", type=int, default=None, help="qwen3moe 128, qwen35moe 256")
    p.add_argument("--ff", type=int, default=None,
                   help="qwen3moe only: feed_forward_length (6144; unused by qwen3moe's MoE layers)")
    p.add_argument("--ctx", type=int, default=None, help="context_length (qwen3moe 40960, qwen35moe 262144)")
    p.add_argument("--rope-base", type=float, default=None, help="qwen3moe 1e6, qwen35moe 1e7")
    p.add_argument("--shared-inter", type=int, default=None, help="qwen35moe: shared expert intermediate size (512)")
    p.add_argument("--full-attn-interval", type=int, default=None,
                   help="qwen35moe: every n-th layer is full attention, the others Gated DeltaNet (4)")
    p.add_argument("--linear-key-heads", type=int, default=None, help="qwen35moe: Gated DeltaNet key heads (16)")
    p.add_argument("--linear-value-heads", type=int, default=None, help="qwen35moe: Gated DeltaNet value heads (32)")
    p.add_argument("--linear-head-dim", type=int, default=None,
                   help="qwen35moe: Gated DeltaNet key and value head dim (128)")
    p.add_argument("--conv-kernel", type=int, default=None, help="qwen35moe: Gated DeltaNet conv kernel (4)")
    p.add_argument("--rope-dim", type=int, default=None,
                   help="qwen35moe: rotated dims per head (head_dim * 0.25, i.e. 64)")
    p.add_argument("--rope-sections", type=str, default=None,
                   help="qwen35moe: IMRoPE sections, 4 comma-separated ints (11,11,10,0 for --rope-dim 64)")
    gm.add_options(p)
    go.add_options(p)
    p.add_argument("--rms-eps", type=float, default=None, help="1e-6 (gpt-oss 1e-5)")
    p.add_argument("--std", type=float, default=0.02)
    p.add_argument("--scales", choices=["residual", "uniform"], default="residual",
                   help="residual (default): embedding std 1 and residual-stream writers --std / sqrt(2 x layers), "
                        "routing near-uniform; uniform: --std everywhere (routing collapses)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=sorted(FILE_TYPE), default="bf16", help="the matrices' type with --quant bf16")
    p.add_argument("--quant", choices=["bf16", *gq.FTYPES, "mxfp4"], default=None,
                   help="bf16 (the default but for gpt-oss: float matrices of --dtype), or the tensor types "
                        "llama-quantize gives a q8_0 / q4_k_m file, written as random valid blocks; mxfp4: "
                        "gpt-oss's released types (its default and only choice)")
    p.add_argument("--vocab-from", type=Path, default=None,
                   help="GGUF to copy the tokenizer from (default: models/ggml-vocab-qwen2.gguf of the "
                        "llama.cpp tree in $LLAMA_CPP_DIR, /tmp/llama.cpp or .peer-cpu/llama.cpp, else "
                        "taken out of .peer/llama.cpp.tar.xz)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--wheels", type=Path, default=REPO / ".whl")
    p.add_argument("--max-gib", type=float, default=None,
                   help="use the largest layer count up to --layers whose file is at most this many GiB")
    p.add_argument("--plan", action="store_true", help="print the tensors and sizes, write nothing")
    p.add_argument("--force", action="store_true",
                   help="rewrite --out even when OUT.args.json says it already holds these weights")
    args = p.parse_args(argv)
    gpt_oss = args.arch == "gpt-oss"
    args.quant = args.quant or ("mxfp4" if gpt_oss else "bf16")
    if (args.quant == "mxfp4") != gpt_oss:
        p.error(f"--quant {args.quant} with --arch {args.arch}: mxfp4 is gpt-oss's, and gpt-oss is written as "
                "released (MXFP4 experts, Q8_0 attention and embeddings)")
    if args.quant != "bf16" and args.dtype != "bf16":
        p.error(f"--dtype {args.dtype}: only with --quant bf16 (a --quant {args.quant} file's types follow llama-quantize)")
    other = {k for only in ARCH_ONLY.values() for k in only} - set(ARCH_ONLY[args.arch])
    given = [f"--{k.replace('_', '-')}" for k in sorted(other) if getattr(args, k) is not None]
    if given:
        p.error(f"{', '.join(given)}: not an option of --arch {args.arch}")
    for key, value in ARCH_DEFAULTS[args.arch].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.rms_eps is None:
        args.rms_eps = 1e-6
    if args.arch in HYBRIDS:
        check_qwen35(p, args)
    return args


def check_qwen35(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Resolve --rope-dim / --rope-sections and refuse shapes llama.cpp's qwen35moe graph cannot run."""
    if args.rope_dim is None:
        args.rope_dim = int(args.head_dim * PARTIAL_ROTARY)
    if not (0 < args.rope_dim <= args.head_dim and args.rope_dim % 2 == 0):
        p.error(f"--rope-dim {args.rope_dim}: need an even number in (0, --head-dim {args.head_dim}]")
    if args.arch == "qwen3next":  # NEOX rotary over rope_dim: no sections
        pass
    elif args.rope_sections is None:
        args.rope_sections = mrope_sections(args.rope_dim)
    else:
        try:
            args.rope_sections = [int(x) for x in args.rope_sections.split(",")]
        except ValueError:
            p.error(f"--rope-sections {args.rope_sections!r}: need 4 comma-separated ints")
    if args.arch == "qwen35moe" and (len(args.rope_sections) != 4 or min(args.rope_sections) < 0
                                     or sum(args.rope_sections[:3]) == 0):
        p.error(f"--rope-sections {args.rope_sections}: need 4 non-negative ints, one of the first 3 positive")
    if args.full_attn_interval < 1 or args.layers % args.full_attn_interval != 0:
        p.error(f"--layers {args.layers} is not a multiple of --full-attn-interval {args.full_attn_interval}: "
                "the model would not end on a full-attention layer (Qwen3.5/3.6's 3:1 pattern has "
                f"{args.full_attn_interval - 1} Gated DeltaNet layers before each full-attention one)")
    if args.linear_key_heads < 1 or args.linear_value_heads % args.linear_key_heads != 0:
        p.error("--linear-value-heads must be a multiple of --linear-key-heads (llama.cpp repeats key heads)")
    for key in ("shared_inter", "linear_head_dim", "conv_kernel"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be positive")


VOCAB_NAME = "models/ggml-vocab-qwen2.gguf"


def default_vocab() -> Path:
    """llama.cpp's qwen2 vocabulary: from an extracted tree, else out of .peer/llama.cpp.tar.xz."""
    roots = [os.environ.get("LLAMA_CPP_DIR", ""), "/tmp/llama.cpp", str(REPO / ".peer-cpu" / "llama.cpp")]
    for root in roots:
        if root and (Path(root) / VOCAB_NAME).is_file():
            return Path(root) / VOCAB_NAME
    tarball = REPO / ".peer" / "llama.cpp.tar.xz"
    if tarball.is_file():
        dest = Path(tempfile.mkdtemp(prefix="peer-vocab-")) / Path(VOCAB_NAME).name
        with tarfile.open(tarball, "r:xz") as tar:
            member = tar.extractfile(f"llama.cpp/{VOCAB_NAME}")
            if member is not None:
                with member, open(dest, "wb") as f:
                    shutil.copyfileobj(member, f)
                return dest
    raise SystemExit(f"write_gguf.py: no --vocab-from given and no {VOCAB_NAME} in {', '.join(roots)} nor {tarball}")


def stamp_of(args: argparse.Namespace) -> dict[str, Any]:
    """What the file's bytes depend on (the vocabulary by size), stored next to it as OUT.args.json
    (for qwen3moe the same keys as before --arch existed)."""
    keys = ("layers", "experts", "top_k", "hidden", "inter", "heads", "kv_heads", "head_dim", "ff", "ctx",
            "rope_base", "rms_eps", "std", "seed", "dtype")
    stamp = {k: getattr(args, k) for k in keys} | {"chunk": CHUNK, "writer": "write_gguf.py v1"}
    if args.scales != "uniform":  # the files before --scales were uniform: their stamps stay valid
        stamp |= {"scales": args.scales}
    if args.quant != "bf16":
        stamp |= {"quant": args.quant, "qchunk": QCHUNK}
    if args.arch != "qwen3moe":
        stamp |= {"arch": args.arch} | {k: getattr(args, k) for k in ARCH_ONLY[args.arch]}
    return stamp


def vocab_size(gguf: ModuleType, vocab_path: Path | None) -> int:
    """The vocabulary's size: o200k_harmony's when there is no file (gpt-oss), else the file's token count."""
    if vocab_path is None:
        return go.O200K_HARMONY_SIZE
    field = gguf.GGUFReader(str(vocab_path)).fields.get("tokenizer.ggml.tokens")
    if field is None:
        raise SystemExit(f"write_gguf.py: {vocab_path} has no tokenizer.ggml.tokens")
    return len(field.data)


def model_shape(args: argparse.Namespace, n_vocab: int) -> Shape:
    if args.arch in HYBRIDS:
        return Shape(args.layers, args.experts, args.top_k, args.hidden, args.inter, args.heads, args.kv_heads,
                     args.head_dim, n_vocab, args.shared_inter, args.full_attn_interval, args.linear_key_heads,
                     args.linear_value_heads, args.linear_head_dim, args.conv_kernel)
    return Shape(args.layers, args.experts, args.top_k, args.hidden, args.inter, args.heads, args.kv_heads,
                 args.head_dim, n_vocab)


def arch_specs(args: argparse.Namespace, shape: Shape) -> list[TensorSpec]:
    """Every tensor of the file, in order."""
    if args.arch in HYBRIDS:
        return qwen35moe_tensor_specs(shape, fused_ba=args.arch == "qwen3next")
    if args.arch == "deepseek2":
        return [TensorSpec(*t) for t in gm.deepseek2_tensors(args, shape.vocab)]
    if args.arch == "gpt-oss":
        return [TensorSpec(*t) for t in go.tensors(args, shape.vocab)]
    return tensor_specs(shape)


def file_bytes(args: argparse.Namespace, specs: list[TensorSpec]) -> int:
    qtypes = quant_types(specs, args)
    return sum(t.nbytes(args.dtype, qtypes.get(t.name)) for t in specs)


def fit_layers(args: argparse.Namespace, n_vocab: int) -> None:
    """--max-gib: lower args.layers to the largest count whose file fits (a multiple of the hybrids' interval;
    even for gpt-oss, whose layers alternate sliding and full)."""
    if args.max_gib is None:
        return
    step = args.full_attn_interval if args.arch in HYBRIDS else 2 if args.arch == "gpt-oss" else 1
    for n in range(args.layers - args.layers % step, 0, -step):
        args.layers = n
        size = file_bytes(args, arch_specs(args, model_shape(args, n_vocab)))
        if size <= args.max_gib * GIB:
            print(f"write_gguf: --max-gib {args.max_gib}: {n} layers ({size / GIB:.2f} GiB)", flush=True)
            return
    raise SystemExit(f"write_gguf.py: not even {step} layer(s) fit in --max-gib {args.max_gib}")


def add_hparams(writer: Any, args: argparse.Namespace, shape: Shape) -> None:
    arch = args.arch
    if arch in HYBRIDS:
        add_qwen35moe_hparams(writer, arch, shape, args)
    elif arch == "deepseek2":
        gm.add_deepseek2_hparams(writer, arch, args, shape.vocab)
    elif arch == "gpt-oss":
        go.add_hparams(writer, arch, args)
    else:
        writer.add_uint32(f"{arch}.context_length", args.ctx)
        writer.add_uint32(f"{arch}.embedding_length", shape.hidden)
        writer.add_uint32(f"{arch}.block_count", shape.layers)
        writer.add_uint32(f"{arch}.feed_forward_length", args.ff)
        writer.add_uint32(f"{arch}.attention.head_count", shape.heads)
        writer.add_uint32(f"{arch}.attention.head_count_kv", shape.kv_heads)
        writer.add_uint32(f"{arch}.attention.key_length", shape.head_dim)
        writer.add_uint32(f"{arch}.attention.value_length", shape.head_dim)
        writer.add_uint32(f"{arch}.rope.dimension_count", shape.head_dim)
        writer.add_float32(f"{arch}.rope.freq_base", args.rope_base)
        writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", args.rms_eps)
        writer.add_uint32(f"{arch}.expert_count", shape.experts)
        writer.add_uint32(f"{arch}.expert_used_count", shape.top_k)
        writer.add_uint32(f"{arch}.expert_feed_forward_length", shape.inter)


def write(args: argparse.Namespace) -> dict[str, float]:
    gguf = import_gguf(args.wheels)
    built_vocab = args.vocab_from is None and args.arch == "gpt-oss"  # o200k_harmony, built from bpe-openai
    vocab_path = None if built_vocab else (args.vocab_from or default_vocab())
    n_vocab = vocab_size(gguf, vocab_path)
    fit_layers(args, n_vocab)
    stamp_path = args.out.with_name(args.out.name + ".args.json")
    stamp = stamp_of(args) | ({"vocab": "o200k_harmony"} if vocab_path is None
                              else {"vocab_bytes": vocab_path.stat().st_size})
    if not args.force and not args.plan and args.out.is_file() and stamp_path.is_file():
        try:
            same = json.loads(stamp_path.read_text()) == stamp
        except (OSError, ValueError):
            same = False
        if same:
            print(f"write_gguf: {args.out} already holds these weights ({stamp_path.name} matches); "
                  "not rewriting it (--force does)", flush=True)
            return {"bytes": float(args.out.stat().st_size), "seconds": 0.0}
    arch = args.arch
    part = args.out.with_name(args.out.name + ".part")
    writer = gguf.GGUFWriter(str(part), arch)
    if vocab_path is None:
        go.add_o200k_harmony(writer)
    else:
        copy_tokenizer(gguf, writer, vocab_path)
    shape = model_shape(args, n_vocab)
    if not (0 < shape.top_k <= shape.experts):
        raise SystemExit("write_gguf.py: need 0 < --top-k <= --experts")

    writer.add_name(f"random {arch} {shape.layers}L {shape.experts}x{shape.inter} top{shape.top_k}")
    writer.add_description(f"random weights (seed {args.seed}, normal std {args.std}, {args.scales} scales), written by "
                           "freetoken-agent evals/peer/write_gguf.py; not a trained model")
    ftype = gq.MXFP4_MOE if args.quant == "mxfp4" else (
        gq.FTYPES[args.quant][0] if args.quant in gq.FTYPES else FILE_TYPE[args.dtype])
    writer.add_file_type(ftype)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_hparams(writer, args, shape)
    specs = arch_specs(args, shape)

    qtypes = quant_types(specs, args)
    total = sum(t.nbytes(args.dtype, qtypes.get(t.name)) for t in specs)
    experts = sum(t.nbytes(args.dtype, qtypes.get(t.name)) for t in specs if "_exps." in t.name)
    layout = ""
    if arch in HYBRIDS:
        n_full = sum(shape.is_full_attention(i) for i in range(shape.layers))
        layout = f", {n_full} full-attention + {shape.layers - n_full} Gated DeltaNet layers"
    print(f"write_gguf: {arch}, {len(specs)} tensors, {total / GIB:.2f} GiB ({experts / GIB:.2f} GiB experts)"
          f"{layout}, {args.quant if qtypes else args.dtype}, vocab {n_vocab} from "
          f"{vocab_path or 'o200k_harmony (bpe-openai)'}", flush=True)
    if qtypes:
        mix: dict[str, int] = {}
        for q in qtypes.values():
            mix[gq.TYPE_NAME[q]] = mix.get(gq.TYPE_NAME[q], 0) + 1
        print("write_gguf: tensor types " + ", ".join(f"{k} x{v}" for k, v in sorted(mix.items())), flush=True)
    if args.plan:
        for t in specs:
            kind = gq.TYPE_NAME[qtypes[t.name]] if qtypes else t.kind
            print(f"  {t.name:32s} {kind:6s} {t.shape!s:24s} {t.nbytes(args.dtype, qtypes.get(t.name)) / 2**20:10.2f} MiB")
        return {"bytes": float(total), "seconds": 0.0}

    args.out.parent.mkdir(parents=True, exist_ok=True)
    for old in (args.out, stamp_path, part):  # a stale file would hold the disk space this one needs
        old.unlink(missing_ok=True)
    free = shutil.disk_usage(args.out.parent).free
    if free < total + (256 << 20):
        raise SystemExit(f"write_gguf.py: {args.out.parent} has {free / GIB:.1f} GiB free, the file needs "
                         f"{total / GIB:.1f} GiB")
    for t in specs:
        qt = qtypes.get(t.name)
        if qt in gq.UNIT_RMS:
            rb = gq.row_bytes(qt, t.shape[-1])
            writer.add_tensor_info(t.name, (*t.shape[:-1], rb), np.dtype(np.uint8), t.nbytes(args.dtype, qt),
                                   raw_dtype=gguf.GGMLQuantizationType(qt))
            continue
        if qt == gq.F16:
            writer.add_tensor_info(t.name, t.shape, np.dtype(np.float16), t.nbytes(args.dtype, qt))
            continue
        np_dtype: Any = np.uint16 if (t.kind == "mat" and args.dtype == "bf16") else (
            np.float16 if t.kind == "mat" else np.float32)
        raw = gguf.GGMLQuantizationType.BF16 if (t.kind == "mat" and args.dtype == "bf16") else None
        writer.add_tensor_info(t.name, t.shape, np.dtype(np_dtype), t.nbytes(args.dtype), raw_dtype=raw)

    t0 = time.perf_counter()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    done = 0
    lock = threading.Lock()
    last_print = [t0]

    def write_one(arr: np.ndarray) -> None:
        nonlocal done
        writer.write_tensor_data(arr)
        with lock:
            done += arr.nbytes
            now = time.perf_counter()
            if now - last_print[0] > 5.0:
                last_print[0] = now
                print(f"  {done / GIB:7.2f} / {total / GIB:.2f} GiB, {done / GIB / (now - t0):.2f} GiB/s", flush=True)

    with ThreadPoolExecutor(max(1, args.threads)) as pool, ThreadPoolExecutor(1) as io:
        pending: Future[None] | None = None
        for arr in _generate(pool, specs, args, qtypes):
            if pending is not None:
                pending.result()
            pending = io.submit(write_one, arr)
        if pending is not None:
            pending.result()
    gen_s = time.perf_counter() - t0
    writer.close()
    part.rename(args.out)
    stamp_path.write_text(json.dumps(stamp, indent=1))
    size = args.out.stat().st_size
    print(f"write_gguf: wrote {args.out} ({size / GIB:.2f} GiB) in {gen_s:.1f} s: {size / GIB / gen_s:.2f} GiB/s "
          f"({args.threads} threads, seed {args.seed})", flush=True)
    return {"bytes": float(size), "seconds": gen_s}


def add_qwen35moe_hparams(writer: Any, arch: str, shape: Shape, args: argparse.Namespace) -> None:
    """The keys llama.cpp's qwen35moe loader reads: the common ones (llama_model_base::load_hparams:
    context_length, embedding_length, block_count required; head counts, key/value length, rope
    dimension count and base, expert counts optional) and load_arch_hparams' (rms eps, rope
    dimension_sections (4 int32) and the five ssm.* keys required; expert and shared-expert
    feed-forward lengths and full_attention_interval optional). No feed_forward_length: with the
    expert lengths given, the loader never uses it."""
    writer.add_uint32(f"{arch}.context_length", args.ctx)
    writer.add_uint32(f"{arch}.embedding_length", shape.hidden)
    writer.add_uint32(f"{arch}.block_count", shape.layers)
    writer.add_uint32(f"{arch}.attention.head_count", shape.heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", shape.kv_heads)
    writer.add_uint32(f"{arch}.attention.key_length", shape.head_dim)
    writer.add_uint32(f"{arch}.attention.value_length", shape.head_dim)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", args.rms_eps)
    writer.add_uint32(f"{arch}.rope.dimension_count", args.rope_dim)
    if arch == "qwen35moe":  # IMRoPE; qwen3next rotates rope_dim dims (NEOX)
        writer.add_array(f"{arch}.rope.dimension_sections", [int(x) for x in args.rope_sections])
    writer.add_float32(f"{arch}.rope.freq_base", args.rope_base)
    writer.add_uint32(f"{arch}.expert_count", shape.experts)
    writer.add_uint32(f"{arch}.expert_used_count", shape.top_k)
    writer.add_uint32(f"{arch}.expert_feed_forward_length", shape.inter)
    writer.add_uint32(f"{arch}.expert_shared_feed_forward_length", shape.shared_inter)
    writer.add_uint32(f"{arch}.full_attention_interval", shape.full_attn_interval)
    writer.add_uint32(f"{arch}.ssm.conv_kernel", shape.conv_kernel)
    writer.add_uint32(f"{arch}.ssm.state_size", shape.linear_head_dim)
    writer.add_uint32(f"{arch}.ssm.group_count", shape.linear_key_heads)
    writer.add_uint32(f"{arch}.ssm.time_step_rank", shape.linear_value_heads)
    writer.add_uint32(f"{arch}.ssm.inner_size", shape.linear_value_heads * shape.linear_head_dim)


EMBED_STD = 1.0  # engine/weights/dummy.py's


def tensor_std(spec: TensorSpec, args: argparse.Namespace) -> float:
    """The normal's std for one tensor under --scales (see the module docstring)."""
    if args.scales == "uniform" or not spec.role:
        return float(args.std)
    if spec.role == "embed":
        return EMBED_STD
    return float(args.std) / math.sqrt(2 * args.layers)


def quant_types(specs: list[TensorSpec], args: argparse.Namespace) -> dict[str, int]:
    """{name: ggml type} of every tensor for --quant q8_0 / q4_k_m (gguf_quant.tensor_types, the source
    being the bf16 file: matrices bf16, the rest float32); {} for --quant bf16."""
    if args.quant == "bf16":
        return {}
    if args.arch == "gpt-oss":
        return go.tensor_types([(t.name, t.shape, t.kind) for t in specs])
    src = [(t.name, t.shape, gq.BF16 if t.kind == "mat" else gq.F32) for t in specs]
    return gq.tensor_types(src, args.quant, args.layers, args.experts)


def _generate(pool: ThreadPoolExecutor, specs: list[TensorSpec], args: argparse.Namespace,
              qtypes: dict[str, int]) -> Iterator[np.ndarray]:
    for t in specs:
        qt = qtypes.get(t.name)
        yield make_tensor(pool, t, args.seed, tensor_std(t, args), args.dtype, None if qt in (gq.F32, gq.BF16) else qt)


def main(argv: list[str] | None = None) -> int:
    write(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
