#!/usr/bin/env python3
"""Check that our engine and llama.cpp compute the same function on the same GGUF.

Contract:
    python3 evals/peer/check_logits.py --llama-src SRC --llama-build BUILD [--vocab-from VOCAB.gguf]
        [--tokens 24] [--seed 0] [--tol 0.02]

- builds evals/peer/dump_logits.cpp against a llama.cpp source tree (SRC: include/, ggml/include/)
  and a CPU build of it (BUILD: src/libllama.a, ggml/src/libggml*.a; evals/peer/fetch_source.sh's
  verify build, or `cmake -DGGML_CUDA=OFF` + `ninja llama-bench` from .peer/llama.cpp.tar.xz);
- writes a tiny random GGUF of --arch (qwen3moe, the qwen35moe hybrid, or gpt-oss: its released types,
  MXFP4 experts and Q8_0 attention, whatever --dtype says) with
  evals/peer/write_gguf.py (--dtype f16 by default: llama.cpp's CPU matmuls round activations to
  the weights' type, and bf16's 8 bits leave differences of a few percent after the Gated DeltaNet
  layers' normalisations, f16's 11 bits a tenth of a percent; with --vocab-from the tokenizer of
  that GGUF, else a 300-token stand-in);
- runs llama.cpp (CPU, one thread) and our engine (engine/weights/gguf_reader.py, float32, torch
  executor) over the same token ids, one prompt, every position's logits;
- leaves out the positions whose expert choice is a near tie in some layer (the k-th and (k+1)-th
  routing probabilities within --tie: llama.cpp's rounding may pick the other expert there; for the
  hybrid also every later position, which the recurrent state carries the difference to; at least
  8 positions must remain), prints the largest difference relative to the
  largest logit and the share of positions whose top token agrees; exits 1 when the difference
  passes --tol or a top token differs where llama.cpp's top two logits are further apart than
  twice the largest difference; `--control` swaps our gate and up experts first (float or packed
  banks), to show the check fails when a tensor is read in the wrong role.
So the two agree to a fraction of a percent, not bit for bit; a tensor read in the wrong role gives
differences of order 1.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
# tiny shapes: Qwen3-MoE, and a Qwen3.5-MoE hybrid (three Gated DeltaNet layers and one full attention, two value
# heads per key head so the head order matters, partial rotary, a shared expert)
SHAPES = {
    "qwen3moe": ["--layers", "2", "--experts", "8", "--top-k", "2", "--hidden", "64", "--inter", "32", "--heads", "4",
                 "--kv-heads", "2", "--head-dim", "16"],
    "qwen35moe": ["--layers", "4", "--experts", "8", "--top-k", "2", "--hidden", "64", "--inter", "32",
                  "--shared-inter", "24", "--heads", "4", "--kv-heads", "2", "--head-dim", "64", "--linear-key-heads",
                  "2", "--linear-value-heads", "4", "--linear-head-dim", "16"],
    # gpt-oss: a window of 8 (the prompt runs past it), sinks, biases, YaRN; rows of 32 for MXFP4 / Q8_0
    "gpt-oss": ["--layers", "4", "--experts", "8", "--top-k", "2", "--hidden", "64", "--inter", "64", "--heads", "4",
                "--kv-heads", "2", "--head-dim", "16", "--sliding-window", "8"],
}
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))


def build_dumper(src: Path, build: Path, out: Path) -> Path:
    libs = [build / "src" / "libllama.a", build / "ggml" / "src" / "libggml.a",
            build / "ggml" / "src" / "libggml-cpu.a", build / "ggml" / "src" / "libggml-base.a"]
    missing = [str(p) for p in libs if not p.exists()]
    if missing:
        sys.exit(f"check_logits: not a CPU llama.cpp build (missing {', '.join(missing)})")
    cmd = ["g++", "-O2", "-std=c++17", f"-I{src / 'include'}", f"-I{src / 'ggml' / 'include'}",
           str(REPO / "evals" / "peer" / "dump_logits.cpp"), "-o", str(out), *map(str, libs), "-lpthread", "-lgomp",
           "-ldl"]
    subprocess.run(cmd, check=True)
    return out


def engine_logits(gguf: Path, ids: list[int], control: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Our logits [n, vocab], and per position the smallest gap over the layers between the k-th
    and (k+1)-th routing probability (a near tie may route the other way under other rounding)."""
    import engine.model.router as routers
    from engine.cache.pools import KVPool, StatePool
    from engine.model.batch import ForwardBatch, SeqEntry
    from engine.model.load import load_decoder
    from engine.weights.layout import PackedExpertBanks

    dec = load_decoder(gguf, "cpu", torch.float32, executor="torch")
    banks = dec.weights.experts
    if control:  # gate and up exchanged: what a reader mixing up the two roles would compute
        halves = [*banks.gate_up, banks.b13] if isinstance(banks, PackedExpertBanks) else [banks.w13]
        for t in halves:
            if t is not None and t.numel():
                t.copy_(torch.cat(t.chunk(2, dim=1)[::-1], dim=1))
    n = len(ids)
    kv = KVPool(dec.cfg, n, torch.float32, torch.device("cpu"))
    states = StatePool(dec.cfg, 1, torch.float32, torch.device("cpu"))
    batch = ForwardBatch(torch.tensor(ids), torch.arange(n), [SeqEntry(0, n, 0, torch.arange(n), state_slot=0)])
    gaps = torch.full((n,), float("inf"))
    route = routers.softmax_topk

    def measured_route(x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool):  # type: ignore[no-untyped-def]
        nonlocal gaps
        probs = torch.softmax(torch.nn.functional.linear(x, router).float(), dim=-1).sort(dim=-1, descending=True).values
        gaps = torch.minimum(gaps, probs[:, top_k - 1] - probs[:, top_k])
        return route(x, router, top_k, renormalize)

    biased = routers.ROUTERS["topk_softmax"]  # gpt-oss: top-k of the biased logits, softmax over them

    def measured_biased(x: torch.Tensor, w: Any, cfg: Any):  # type: ignore[no-untyped-def]
        nonlocal gaps
        logits = torch.nn.functional.linear(x, w.router, w.router_bias).float()
        probs = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True).values
        gaps = torch.minimum(gaps, probs[:, cfg.top_k - 1] - probs[:, cfg.top_k])
        return biased(x, w, cfg)

    routers.softmax_topk = measured_route
    routers.ROUTERS["topk_softmax"] = measured_biased
    try:
        logits = dec.logits(dec.forward(batch, kv, states)).numpy()
    finally:
        routers.softmax_topk = route
        routers.ROUTERS["topk_softmax"] = biased
    return logits, gaps.numpy()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--llama-src", type=Path, required=True)
    p.add_argument("--llama-build", type=Path, required=True)
    p.add_argument("--vocab-from", type=Path, default=None)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tol", type=float, default=0.02)
    p.add_argument("--tie", type=float, default=None,
                   help="routing probability gap below which a position is left out (default 0.0003 for f16, 0.002 for bf16 "
                        "and gpt-oss)")
    p.add_argument("--arch", choices=sorted(SHAPES), default="qwen3moe")
    p.add_argument("--dtype", choices=["f16", "bf16"], default="f16",
                   help="weights; llama.cpp's CPU matmuls round activations to it (f16 keeps 3 more bits)")
    p.add_argument("--control", action="store_true", help="swap our gate and up experts: the check must fail")
    args = p.parse_args(argv)
    from peer_gguf import write_gguf_module, write_vocab

    if args.tie is None:  # gpt-oss's Q8_0 / MXFP4 matmuls round llama.cpp's activations to 8 bits, as bf16
        args.tie = 0.0003 if args.dtype == "f16" and args.arch != "gpt-oss" else 0.002

    tmp = Path(tempfile.mkdtemp(prefix="check_logits-"))
    dumper = build_dumper(args.llama_src, args.llama_build, tmp / "dump_logits")
    vocab = args.vocab_from or write_vocab(tmp / "vocab.gguf", 300)
    model = tmp / f"tiny-{args.arch}.gguf"
    dtype = [] if args.arch == "gpt-oss" else ["--dtype", args.dtype]  # gpt-oss: its released types
    assert write_gguf_module().main([
        "--arch", args.arch, "--out", str(model), "--vocab-from", str(vocab), *SHAPES[args.arch], "--std", "0.1",
        "--seed", str(args.seed), "--threads", "1", *dtype]) == 0
    from engine.weights.gguf_reader import GgufReader

    vocab_size = GgufReader(model).config()["vocab_size"]
    ids = [(i * 37 + 11 + args.seed) % vocab_size for i in range(args.tokens)]
    subprocess.run([str(dumper), str(model), str(tmp / "peer.f32"), *map(str, ids)], check=True,
                   stdout=subprocess.DEVNULL)
    peer = np.fromfile(tmp / "peer.f32", dtype=np.float32).reshape(len(ids), -1)
    ours, gaps = engine_logits(model, ids, args.control)
    routed = gaps > args.tie  # positions no rounding can route differently
    if args.arch == "qwen35moe":  # a recurrent state carries a different expert choice to every later position
        routed = np.logical_and.accumulate(routed)
    err = np.abs(ours - peer)[routed]
    rel = float(err.max() / np.abs(peer).max()) if routed.any() else 0.0
    same = (ours.argmax(-1) == peer.argmax(-1))[routed]
    top2 = np.sort(peer[routed], axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 2 * (err.max() if routed.any() else 0)  # top tokens no rounding can flip
    print(f"{len(ids)} positions x {peer.shape[1]} logits, {int((~routed).sum())} left out after a routing near tie "
          f"(gap <= {args.tie}): max |ours - llama.cpp| / max |logit| = {rel:.4f}; top token agrees at "
          f"{same.mean():.0%} of positions, {same[clear].mean() if clear.any() else 1.0:.0%} of {int(clear.sum())} "
          f"clear-cut ones")
    return 0 if routed.sum() >= 8 and rel <= args.tol and same[clear].all() else 1


if __name__ == "__main__":
    sys.exit(main())
