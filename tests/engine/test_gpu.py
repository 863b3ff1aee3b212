"""GPU paths of the engine (run on the lent GPU machine; skipped without CUDA).

Proves: the engine on CUDA gives the reference's logits for prefill and 32 decode steps, both with
the torch Gated DeltaNet ops and with fla-core's Triton kernels (chunked for prefill, fused
recurrent for decode, one varlen call per batch), and that concurrent requests batched through the
fla varlen path give the same tokens as each alone.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoints import FULL, LIN, TinySpec, qwen3_5_moe_text, qwen3_moe_text, rel_err

from engine.model.linear_attention import _import_fla
from engine.sampling import SamplingParams

pytestmark = pytest.mark.gpu

# transformers binds fla's Triton kernels at import when fla is installed, and they refuse the CPU
# tensors of the float32 reference; so the reference runs in a child process that cannot import fla.
_REFERENCE = """
import sys, torch
sys.modules["fla"] = None
sys.path.insert(0, sys.argv[1])
from transformers import AutoModelForCausalLM
from checkpoints import hf_prefill_logits, hf_step_logits
model = AutoModelForCausalLM.from_pretrained(sys.argv[2], dtype=torch.float32).eval()
args = torch.load(sys.argv[3])
torch.save({"steps": hf_step_logits(model, args["prompt"], args["fed"]),
            "full": hf_prefill_logits(model, args["prompt"] + args["fed"])}, sys.argv[3])
"""


def reference(path: Path, prompt: list[int], fed: list[int], tmp: Path) -> dict[str, torch.Tensor]:
    io = tmp / "ref.pt"
    torch.save({"prompt": prompt, "fed": fed}, io)
    proc = subprocess.run([sys.executable, "-c", _REFERENCE, str(Path(__file__).parent), str(path), str(io)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return torch.load(io)


SPECS = [
    TinySpec("gpu_q35", "qwen3_5_moe", qwen3_5_moe_text(layer_types=[LIN, FULL, LIN, FULL])),
    TinySpec("gpu_q3", "qwen3_moe", qwen3_moe_text()),
]


@pytest.mark.parametrize("gdn", ["torch", "fla"])
@pytest.mark.parametrize("spec", SPECS, ids=repr)
def test_cuda_logits_match_reference(spec: TinySpec, gdn: str, tiny_checkpoint, make_engine, monkeypatch,  # type: ignore[no-untyped-def]
                                     tmp_path: Path) -> None:
    if gdn == "fla":
        if spec.family != "qwen3_5_moe":
            pytest.skip("no linear attention in this family")
        if _import_fla() is None:
            pytest.fail("fla-core is not importable on this CUDA machine")
    # fp32 reference matmuls, no TF32, on both sides.
    torch.backends.cuda.matmul.allow_tf32 = False
    path, _ = tiny_checkpoint(spec)
    prompt = [int(t) for t in torch.randint(0, 128, (150,), generator=torch.Generator().manual_seed(3))]
    engine = make_engine(path, device="cuda", gdn=gdn)
    handle = engine.submit(prompt, SamplingParams(max_tokens=32, ignore_eos=True), capture_logits=True)
    out = handle.result()
    ref = reference(path, prompt, out[:-1], tmp_path)
    got = torch.stack(handle.logits)
    # fla's Triton dots run in TF32 (forced here at float32 to compare with the reference).
    tol = 1e-4 if gdn == "torch" else 1.5e-2
    err = rel_err(got, ref["steps"])
    print(f"{spec.name} gdn={gdn}: max relative error, prefill {rel_err(got[0], ref['steps'][0]):.2e}, "
          f"prefill + 32 decode steps {err:.2e}")
    assert err <= tol
    assert rel_err(got[0], ref["full"][len(prompt) - 1]) <= tol
    assert out == ref["steps"].argmax(-1).tolist()


def test_fla_kernels_match_torch_ops_in_float32() -> None:
    """Kernel level: fla's chunked rule (prefill chunks; decode steps use the torch recurrence)
    against `gdn_ops` on random inputs, with grouped value heads (2 value heads per key head)."""
    from engine.model import gdn_ops

    kernels = _import_fla()
    if kernels is None:
        pytest.fail("fla-core is not importable on this CUDA machine")
    chunk_rule = kernels
    gen = torch.Generator().manual_seed(0)
    hk, hv, dk, dv = 2, 4, 32, 48
    for length, rule in ((200, chunk_rule), (2, chunk_rule)):
        q, k = torch.randn(length, hk, dk, generator=gen), torch.randn(length, hk, dk, generator=gen)
        v = torch.randn(length, hv, dv, generator=gen)
        g = -torch.rand(length, hv, generator=gen) * 0.5
        beta = torch.rand(length, hv, generator=gen)
        s0 = torch.randn(hv, dk, dv, generator=gen) * 0.1
        ref_o, ref_s = gdn_ops.gated_delta_rule(q.repeat_interleave(2, 1), k.repeat_interleave(2, 1), v, g, beta, s0)
        cu = torch.tensor([0, length], device="cuda")
        o, s = rule(q=q.cuda()[None], k=k.cuda()[None], v=v.cuda()[None], g=g.cuda()[None], beta=beta.cuda()[None],
                    initial_state=s0.cuda()[None], output_final_state=True, use_qk_l2norm_in_kernel=True,
                    cu_seqlens=cu)
        err_o, err_s = rel_err(o[0].cpu(), ref_o), rel_err(s[0].cpu(), ref_s)
        print(f"fla chunk T={length}: output {err_o:.2e}, state {err_s:.2e}")
        assert err_o <= 5e-3 and err_s <= 5e-3


def test_bf16_fla_path_tracks_torch_path(tiny_checkpoint, make_engine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """bf16 models use fla by default. Against the float32 engine, fla's bf16 logits must be about
    as close as the torch-op path's bf16 logits are (bf16 rounding dominates both)."""
    if _import_fla() is None:
        pytest.fail("fla-core is not importable on this CUDA machine")
    path, _ = tiny_checkpoint(SPECS[0])
    prompt = [int(t) for t in torch.randint(0, 128, (150,), generator=torch.Generator().manual_seed(4))]
    rows = {}
    for gdn, dtype in (("torch", "float32"), ("torch", "bfloat16"), ("auto", "bfloat16")):
        engine = make_engine(path, device="cuda", dtype=dtype, gdn=gdn)
        h = engine.submit(prompt, SamplingParams(max_tokens=1), capture_logits=True)
        h.result()
        rows[gdn, dtype] = h.logits[0]
        engine.close()
    exact = rows["torch", "float32"]
    err_torch, err_fla = rel_err(rows["torch", "bfloat16"], exact), rel_err(rows["auto", "bfloat16"], exact)
    print(f"bf16 prefill logits vs float32: torch ops {err_torch:.2e}, fla {err_fla:.2e}")
    assert err_fla <= 2 * err_torch + 1e-2


def test_fla_varlen_batch_equals_single(tiny_checkpoint, make_engine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    if _import_fla() is None:
        pytest.fail("fla-core is not importable on this CUDA machine")
    path, _ = tiny_checkpoint(SPECS[0])
    engine = make_engine(path, device="cuda", gdn="fla")
    gen = torch.Generator().manual_seed(5)
    prompts = [[int(t) for t in torch.randint(0, 128, (n,), generator=gen)] for n in (7, 70, 130, 33)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    alone = [engine.submit(p, params).result() for p in prompts]
    with engine._step_lock:
        engine.scheduler.cache.reset()
    together = [engine.submit(p, params) for p in prompts]
    assert [h.result() for h in together] == alone


def test_fla_cuts_inside_a_chunk_equal_cold_prefills(tiny_checkpoint, make_engine) -> None:  # type: ignore[no-untyped-def]
    """Checkpoints inside one pass on fla's path (rounds of varlen calls,
    engine/model/linear_attention.py `_fla_pieces`): two prompts prefilled together, one with cuts
    at 40, 97 and 149 (its last piece a single token), the other with one at 60 (four and two
    pieces); a request resumed from each checkpoint gives the greedy tokens and, within fla's TF32
    error, the logits of a cold prefill of the same prompt."""
    from engine.anchors import Anchor

    if _import_fla() is None:
        pytest.fail("fla-core is not importable on this CUDA machine")
    path, _ = tiny_checkpoint(SPECS[0])
    engine = make_engine(path, device="cuda", gdn="fla")
    gen = torch.Generator().manual_seed(6)
    a, b = ([int(t) for t in torch.randint(0, 128, (n,), generator=gen)] for n in (150, 90))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    first = [engine.submit(a, params, anchors=[Anchor(40, "system_end", 5), Anchor(97, "user_start", 1),
                                               Anchor(149, "prompt_end", 2)]),
             engine.submit(b, params, anchors=[Anchor(60, "user_start", 1)])]
    for h in first:
        h.result(timeout=120)
    cases = [(a, 40), (a, 97), (a, 149), (b, 60)]
    resumed = []
    for prompt, p in cases:
        h = engine.submit([*prompt[:p], 7, 8, 9], params, capture_logits=True)
        h.result(timeout=120)
        assert h.reuse is not None and h.reuse.state_position == p, (p, h.reuse)
        resumed.append(h)
    for (prompt, p), h in zip(cases, resumed, strict=True):
        engine.reset_cache()
        cold = engine.submit([*prompt[:p], 7, 8, 9], params, capture_logits=True)
        assert cold.result(timeout=120) == h.output_ids
        err = rel_err(torch.stack(h.logits).cpu(), torch.stack(cold.logits).cpu())
        print(f"resumed at {p}: logits vs cold {err:.2e}")
        assert err <= 1.5e-2  # fla's TF32 bound, as test_cuda_logits_match_reference's
