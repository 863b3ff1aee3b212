"""Biased, clamped-SwiGLU experts (gpt-oss) in the packed GPU kernels (engine/gpu/quant/gemv.py and
grouped.py), their biases in the slots' bias block (engine/gpu/quant/slots.py), against the CPU
reference `torch_moe_packed` (engine/moe/packed.py) on the same random banks and biases:
- mxfp4 and q4_k banks, gate / up / down biases large enough that the clamp bites (checked: the
  reference with the clamp out of reach differs), activation "swiglu_clamped" (gpt-oss's alpha 1.702,
  limit 7) and "silu" with biases; experts in shuffled slots, an entry without an expert (id -1);
- the decode GEMV split around a fetch: the fetched slots' bytes and biases are NaN until `between()`
  lands them with `copy_in(..., bias=...)`, and the rows equal the unsplit call's bit for bit;
- silu without biases is unchanged: a zero bias block gives the same rows, bit for bit, as slots
  without one; a bias without a block, of the wrong length, or an unknown activation is a ValueError.
On a CPU through Triton's interpreter; on CUDA directly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from quant_reference import random_rows
from triton_interpreter import run_in_interpreter

from engine.gpu.quant.slots import ExpertFormat, PackedSlots
from engine.moe.packed import torch_moe_packed

ALPHA, LIMIT = 1.702, 7.0
PAIRS = [("mxfp4", "mxfp4", 64, 32), ("q4_k", "q4_k", 256, 256)]


class Case:
    """E random experts of one format pair with biases, in shuffled slots of a pool with a bias block."""

    def __init__(self, fmt_gu: str, fmt_d: str, hidden: int, inter: int, device: str, seed: int,
                 experts: int = 4) -> None:
        rng = np.random.default_rng(seed)
        g = torch.Generator().manual_seed(seed)
        self.fmt = ExpertFormat(fmt_gu, fmt_d, hidden, inter)
        self.gate_up = torch.from_numpy(np.stack([random_rows(fmt_gu, 2 * inter, hidden, rng, 1 / 4)
                                                  for _ in range(experts)]))
        self.down = torch.from_numpy(np.stack([random_rows(fmt_d, hidden, inter, rng) for _ in range(experts)]))
        self.bias_gu = torch.randn(experts, 2 * inter, generator=g) * 6
        self.bias_d = torch.randn(experts, hidden, generator=g)
        self.slots = PackedSlots.allocate([self.fmt], experts + 1, device, bias=True)
        assert self.slots.bias is not None
        self.bias: torch.Tensor = self.slots.bias  # [slots, 2I + H]
        self.slots.data.random_(0, 256, generator=None)  # garbage in the spare slot
        self.slot_of = torch.randperm(experts + 1, generator=g)[:experts]
        for e in range(experts):
            self.slots.copy_in(int(self.slot_of[e]), self.fmt, self.gate_up[e], self.down[e],
                               bias=torch.cat([self.bias_gu[e], self.bias_d[e]]).to(device))
        self.device, self.g = device, g

    def reference(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, activation: str,
                  limit: float = LIMIT, bias: bool = True) -> torch.Tensor:
        out = torch.zeros(x.shape, dtype=torch.float32)
        torch_moe_packed(x, ids, w, self.gate_up, self.fmt.fmt_gu, self.down, self.fmt.fmt_d, None, out,
                         bias_gu=self.bias_gu if bias else None, bias_d=self.bias_d if bias else None,
                         activation=activation, alpha=ALPHA, limit=limit)
        return out

    def slot_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.where(ids < 0, -1, self.slot_of[ids.clamp(min=0)])


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))


def check_gemv(device: str, pairs: list[tuple[str, str, int, int]] = PAIRS) -> int:
    from engine.gpu.quant.gemv import packed_expert_rows, packed_slot_experts

    for i, (fgu, fd, h, inter) in enumerate(pairs):
        c = Case(fgu, fd, h, inter, device, seed=40 + i)
        x = torch.randn(3, h, generator=c.g)
        ids = torch.tensor([[2, 0], [-1, 3], [1, 2]])
        w = torch.rand(3, 2, generator=c.g)
        want = c.reference(x, ids, w, "swiglu_clamped")
        assert (want - c.reference(x, ids, w, "swiglu_clamped", limit=1e4)).abs().max() > 0.1 * want.abs().max()
        dev = [t.to(device) for t in (x, ids, c.slot_ids(ids), w)]
        rows = packed_expert_rows(dev[0], dev[2], dev[3], c.slots, c.fmt, activation="swiglu_clamped", alpha=ALPHA,
                                  limit=LIMIT)
        assert torch.all(rows[2] == 0)  # the entry without an expert
        _close(rows.view(3, 2, h).sum(dim=1).cpu(), want)
        silu = packed_slot_experts(dev[0], dev[1], dev[2], dev[3], c.slots, c.fmt).cpu()
        _close(silu, c.reference(x, ids, w, "silu"))
        # split around a fetch: slots 0 and the slot of expert 1 hold NaN bytes and biases until between()
        fetched = sorted({0, int(c.slot_of[1])})
        garbage = PackedSlots(c.slots.data.clone(), c.slots.gscale.clone(), c.bias.clone())
        garbage.data[fetched] = 0xFF
        assert garbage.bias is not None
        garbage.bias[fetched] = float("nan")

        def land(dst: PackedSlots = garbage, src: Case = c, slots: list[int] = fetched) -> None:
            for s in slots:
                dst.copy_in(s, src.fmt, src.slots.gate_up(src.fmt)[s], src.slots.down(src.fmt)[s],
                            bias=src.bias[s, :src.fmt.bias_width])

        copy_dst = torch.tensor(fetched + [-1] * 3, device=device)
        split = packed_expert_rows(dev[0], dev[2], dev[3], garbage, c.fmt, copy_dst, land,
                                   activation="swiglu_clamped", alpha=ALPHA, limit=LIMIT)
        assert torch.equal(split, rows)
    return len(pairs)


def check_grouped(device: str, pairs: list[tuple[str, str, int, int]] = PAIRS, tokens: int = 5) -> int:
    from engine.gpu.quant.grouped import packed_grouped_experts

    for i, (fgu, fd, h, inter) in enumerate(pairs):
        c = Case(fgu, fd, h, inter, device, seed=50 + i)
        x = torch.randn(tokens, h, generator=c.g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(4, generator=c.g)[:2] for _ in range(tokens)])
        w = torch.rand(tokens, 2, generator=c.g)
        xd, idd, wd, slot_of = (t.to(device) for t in (x, ids, w, c.slot_of))
        for act in ("swiglu_clamped", "silu"):
            got = packed_grouped_experts(xd, idd, wd, slot_of, c.slots, c.fmt, activation=act, alpha=ALPHA,
                                         limit=LIMIT).cpu()
            _close(got, c.reference(x.float(), ids, w, act))
    return len(pairs)


def check_unchanged_without_bias(device: str) -> int:
    """silu without biases: a zero bias block changes no bit of either kernel's result."""
    from engine.gpu.quant.gemv import packed_expert_rows
    from engine.gpu.quant.grouped import packed_grouped_experts

    c = Case("mxfp4", "mxfp4", 64, 32, device, seed=60)
    c.bias.zero_()
    plain = PackedSlots(c.slots.data, c.slots.gscale)
    x = torch.randn(4, 64, generator=c.g).to(device)
    ids = torch.stack([torch.randperm(4, generator=c.g)[:2] for _ in range(4)]).to(device)
    w = torch.rand(4, 2, generator=c.g).to(device)
    sid = c.slot_of.to(device)[ids]
    assert torch.equal(packed_expert_rows(x, sid, w, c.slots, c.fmt), packed_expert_rows(x, sid, w, plain, c.fmt))
    slot_of = c.slot_of.to(device)
    assert torch.equal(packed_grouped_experts(x, ids, w, slot_of, c.slots, c.fmt),
                       packed_grouped_experts(x, ids, w, slot_of, plain, c.fmt))
    _close(packed_expert_rows(x, sid, w, plain, c.fmt).view(4, 2, 64).sum(dim=1).cpu(),
           c.reference(x.cpu(), ids.cpu(), w.cpu(), "silu", bias=False))
    return 1


def test_slots_bias_block_is_checked() -> None:
    fmt = ExpertFormat("mxfp4", "mxfp4", 64, 32)
    plain = PackedSlots.allocate([fmt], 2)
    gu, d = torch.zeros(2 * 32, 34, dtype=torch.uint8), torch.zeros(64, 17, dtype=torch.uint8)
    with pytest.raises(ValueError, match="no bias block"):
        plain.copy_in(0, fmt, gu, d, bias=torch.zeros(128))
    biased = PackedSlots.allocate([fmt], 2, bias=True)
    assert biased.bias is not None and biased.bias.shape == (2, 128)
    assert biased.nbytes == plain.nbytes + 2 * 128 * 4
    with pytest.raises(ValueError, match="an expert's are 128"):
        biased.copy_in(0, fmt, gu, d, bias=torch.zeros(127))
    biased.copy_in(1, fmt, gu, d, bias=torch.arange(128.0))
    assert torch.equal(biased.bias[1], torch.arange(128.0)) and torch.all(biased.bias[0] == 0)
    with pytest.raises(ValueError, match="bias rows of 100 values"):
        PackedSlots(biased.data, biased.gscale, torch.zeros(2, 100)).check(fmt)
    with pytest.raises(ValueError, match="bias: expected"):
        PackedSlots(biased.data, biased.gscale, torch.zeros(3, 128))


def test_slots_for_budget_counts_the_bias() -> None:
    from engine.gpu.quant.slots import slots_for_budget

    fmt = ExpertFormat("mxfp4", "mxfp4", 64, 32)
    per_slot = fmt.nbytes + 12
    assert slots_for_budget(10 * per_slot, [fmt], 100) == 10
    assert slots_for_budget(10 * per_slot, [fmt], 100, bias=True) == 10 * per_slot // (per_slot + 4 * 128)


def test_unknown_activation_is_named() -> None:
    from engine.gpu.quant.gemv import activation_code

    assert activation_code("swiglu_clamped") == 1
    with pytest.raises(ValueError, match="got 'gelu'"):
        activation_code("gelu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_biased_experts_cuda() -> None:
    assert check_gemv("cuda") == 2
    assert check_grouped("cuda") == 2
    assert check_unchanged_without_bias("cuda") == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_biased_experts_gpt_oss_shape_cuda() -> None:
    """gpt-oss's expert shape (H = I = 2880, MXFP4): both kernels against the reference, then the
    decode GEMV's time for one token and top-4 (CUDA graph replay), biased clamped SwiGLU next to
    silu without biases on the same slots (printed: the epilogue's cost)."""
    from functools import partial

    from test_gemv import _graph_time

    from engine.gpu.quant.gemv import packed_expert_rows

    shape = [("mxfp4", "mxfp4", 2880, 2880)]
    assert check_gemv("cuda", shape) == 1
    assert check_grouped("cuda", shape, tokens=64) == 1
    c = Case("mxfp4", "mxfp4", 2880, 2880, "cuda", seed=70)
    plain = PackedSlots(c.slots.data, c.slots.gscale)
    x = torch.randn(1, 2880, device="cuda", dtype=torch.bfloat16)
    sid = c.slot_of[:4].view(1, 4).cuda()
    w = torch.rand(1, 4, device="cuda")
    biased = _graph_time(partial(packed_expert_rows, x, sid, w, c.slots, c.fmt, activation="swiglu_clamped",
                                 alpha=ALPHA, limit=LIMIT))
    silu = _graph_time(partial(packed_expert_rows, x, sid, w, plain, c.fmt))
    read = 4 * c.fmt.nbytes
    print(f"\n{torch.cuda.get_device_name()} gpt-oss expert GEMV, 1 token, top-4: biased clamped "
          f"{biased * 1e6:.1f} us ({read / biased / 1e9:.0f} GB/s), silu {silu * 1e6:.1f} us "
          f"({read / silu / 1e9:.0f} GB/s)")


def test_biased_experts_in_triton_interpreter() -> None:
    run_in_interpreter(__file__)


if __name__ == "__main__":  # the interpreter test's child
    assert check_gemv("cpu") == 2
    assert check_grouped("cpu") == 2
    assert check_unchanged_without_bias("cpu") == 1
    print("ok")
