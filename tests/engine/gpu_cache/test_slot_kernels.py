"""The decode step's slot-expert GEMVs (engine/gpu/kernels.py `expert_rows`):
- every entry with a slot gives weight * down(silu(gate(x)) * up(x)) read from that slot (float32 to
  1e-5 of the torch ops), an entry without one a zero row;
- split around a fetch (`copy_dst` and `between`, what the host-issued fetch uses): the entries in
  slots outside the copy list run before `between()`, the fetched ones after it, and the rows equal
  the unsplit call's bit for bit, although the fetched slots hold garbage (NaN) until `between()`
  writes them (so no row before it read a fetched slot, and every fetched row read it after);
- no slots at all: zeros (and `between()` still runs);
- the split expert: entries in the scratch slot run its first r rows only, after `between()`.
On a CPU through Triton's interpreter (when triton is installed); on CUDA directly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import run_in_interpreter


def _reference(x: torch.Tensor, slot_ids: torch.Tensor, w: torch.Tensor, w13: torch.Tensor,
               w2: torch.Tensor) -> torch.Tensor:
    n, k = slot_ids.shape
    inter = w2.shape[2]
    rows = torch.zeros(n * k, x.shape[1], dtype=x.dtype)
    for e in range(n * k):
        s = int(slot_ids.view(-1)[e])
        if s < 0:
            continue
        xt = x[e // k:e // k + 1]
        g = F.linear(xt, w13[s, :inter])
        u = F.linear(xt, w13[s, inter:])
        rows[e] = (F.linear(F.silu(g) * u, w2[s]) * w.view(-1)[e])[0]
    return rows


def check(device: str) -> int:
    from engine.gpu.kernels import expert_rows

    cases = 0
    g = torch.Generator().manual_seed(11)
    for dtype in (torch.float32, torch.float16):
        for n, k, hidden, inter, slots in ((1, 8, 64, 32, 10), (3, 4, 96, 48, 12), (2, 2, 32, 16, 0)):
            w13 = (torch.randn(slots, 2 * inter, hidden, generator=g) / 8).to(dtype)
            w2 = (torch.randn(slots, hidden, inter, generator=g) / 8).to(dtype)
            x = torch.randn(n, hidden, generator=g).to(dtype)
            w = torch.rand(n, k, generator=g).to(dtype)
            if slots:
                slot_ids = torch.where(torch.rand(n, k, generator=g) < 0.7,
                                       torch.randint(0, slots, (n, k), generator=g), -1)
                fetched = sorted({int(s) for s in slot_ids.view(-1)[::2] if s >= 0})  # some of the used slots
            else:
                slot_ids, fetched = torch.full((n, k), -1), []
            copy_dst = torch.tensor(fetched + [-1] * (n * k - len(fetched)), dtype=torch.int64)
            dev = [t.to(device) for t in (x, slot_ids, w, w13, w2)]
            whole = expert_rows(*dev).cpu()
            if dtype == torch.float32:
                torch.testing.assert_close(whole, _reference(x, slot_ids, w, w13, w2), rtol=1e-5, atol=1e-5)
            assert torch.all(whole[slot_ids.view(-1) < 0] == 0)
            # the fetched slots hold NaN until between() "lands the copies"
            garbage13, garbage2 = dev[3].clone(), dev[4].clone()
            garbage13[fetched] = float("nan")
            garbage2[fetched] = float("nan")
            calls: list[int] = []

            def land(g13: torch.Tensor = garbage13, g2: torch.Tensor = garbage2, f: list[int] = fetched,
                     real: list[torch.Tensor] = dev, seen: list[int] = calls) -> None:
                seen.append(1)
                g13[f] = real[3][f]
                g2[f] = real[4][f]

            split = expert_rows(dev[0], dev[1], dev[2], garbage13, garbage2, copy_dst.to(device), land).cpu()
            assert calls == [1]
            assert torch.equal(split, whole), (dtype, n, k, hidden, inter, slots)
            cases += 1
    return cases


def check_split_expert(device: str) -> int:
    """The split expert: entries in the scratch slot (index S) run only its first r intermediate
    rows, after `between()` (the scratch holds NaN until then, and NaN past row r for good: never
    read), equal to the whole rows of an expert whose other rows are zero."""
    from engine.gpu.kernels import expert_rows

    g = torch.Generator().manual_seed(12)
    cases = 0
    for n, k, hidden, inter, slots, r in ((1, 8, 64, 64, 6, 32), (2, 4, 96, 96, 5, 64)):
        expert13 = torch.randn(2 * inter, hidden, generator=g) / 8
        expert2 = torch.randn(hidden, inter, generator=g) / 8
        w13 = torch.randn(slots + 1, 2 * inter, hidden, generator=g) / 8
        w2 = torch.randn(slots + 1, hidden, inter, generator=g) / 8
        w13[slots] = float("nan")
        w2[slots] = float("nan")
        x = torch.randn(n, hidden, generator=g)
        w = torch.rand(n, k, generator=g)
        slot_ids = torch.randint(0, slots, (n, k), generator=g)
        slot_ids[:, 1] = slots  # the split expert, routed by every token
        slot_ids[0, 2] = -1  # an entry on the CPU
        want13, want2 = w13.clone(), w2.clone()
        want13[slots] = 0
        want13[slots, :r] = expert13[:r]
        want13[slots, inter:inter + r] = expert13[inter:inter + r]
        want2[slots] = 0
        want2[slots, :, :r] = expert2[:, :r]
        want = _reference(x, slot_ids, w, want13, want2)
        dev = [t.to(device) for t in (x, slot_ids, w, w13, w2)]
        copy_dst = torch.tensor([0] + [-1] * (n * k - 1), dtype=torch.int64, device=device)  # slot 0 "fetched" too
        calls: list[int] = []

        def land(g13: torch.Tensor = dev[3], g2: torch.Tensor = dev[4], s: int = slots, rows: int = r,
                 i: int = inter, e13: torch.Tensor = expert13, e2: torch.Tensor = expert2,
                 seen: list[int] = calls) -> None:
            seen.append(1)
            g13[s, :rows] = e13[:rows].to(g13.device)
            g13[s, i:i + rows] = e13[i:i + rows].to(g13.device)
            g2[s, :, :rows] = e2[:, :rows].to(g2.device)

        split = torch.tensor([77, r], dtype=torch.int64, device=device)
        got = expert_rows(dev[0], dev[1], dev[2], dev[3], dev[4], copy_dst, land, split, slots).cpu()
        assert calls == [1]
        assert not torch.isnan(got).any()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.all(got[slot_ids.view(-1) < 0] == 0)
        cases += 1
    return cases


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_slot_rows_and_their_split_around_a_fetch_cuda() -> None:
    assert check("cuda") == 6
    assert check_split_expert("cuda") == 2


def test_slot_rows_and_their_split_around_a_fetch_in_triton_interpreter() -> None:
    run_in_interpreter(__file__)


if __name__ == "__main__":  # the interpreter test's child
    assert check("cpu") == 6
    assert check_split_expert("cpu") == 2
    print("ok")
