"""The overlapped decode's staging kernels (engine/model/decode_staging.py) against plain torch:
`stage_pass` writes the input ids, positions, new slots, lengths and one table entry per row and
leaves every other table entry alone; `publish_draws` writes the draws and their first column as
ids. Through Triton's interpreter on a CPU; on CUDA with the buffers in page-locked host memory."""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import run_in_interpreter


def check(device: str, pin: bool) -> int:
    from engine.model.decode_staging import publish_draws, stage_pass

    cases = 0
    g = torch.Generator().manual_seed(3)
    for n in (1, 3, 8, 17):
        capacity = 40
        positions = torch.randint(0, capacity, (n,), generator=g)
        slots = torch.randint(0, 10_000, (n,), generator=g)
        host = torch.stack([positions, slots]).contiguous()
        if pin:
            host = host.pin_memory()
        ids = torch.randint(0, 151_000, (n,), generator=g)
        table = torch.randint(0, 10_000, (n, capacity), generator=g, dtype=torch.int32)
        want = table.clone()
        want[torch.arange(n), positions] = slots.to(torch.int32)
        bufs = [torch.full((n,), -7, dtype=torch.long, device=device) for _ in range(3)]
        lengths = torch.zeros(n, dtype=torch.int32, device=device)
        dev_table = table.to(device)
        stage_pass(host, ids.to(device), bufs[0], bufs[1], bufs[2], lengths, dev_table)
        assert torch.equal(bufs[0].cpu(), ids) and torch.equal(bufs[1].cpu(), positions)
        assert torch.equal(bufs[2].cpu(), slots) and torch.equal(lengths.cpu(), (positions + 1).to(torch.int32))
        assert torch.equal(dev_table.cpu(), want), n

        draws = torch.stack([torch.randint(0, 151_000, (n,), generator=g).double(),
                             torch.randint(0, 2, (n,), generator=g).double()], dim=1).contiguous()
        out = torch.full((n, 2), -1.0, dtype=torch.float64)
        if pin:
            out = out.pin_memory()
        next_ids = torch.full((n,), -1, dtype=torch.long, device=device)
        publish_draws(draws.to(device), out, next_ids)
        if device == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(out, draws) and torch.equal(next_ids.cpu(), draws[:, 0].long())
        cases += 1
    with pytest.raises(ValueError, match="staged inputs"):
        stage_pass(torch.zeros(3, 2, dtype=torch.long), torch.zeros(2, dtype=torch.long, device=device),
                   *bufs[:3], lengths, dev_table)
    return cases


def test_kernels_in_triton_interpreter() -> None:
    run_in_interpreter(__file__)


@pytest.mark.gpu
def test_kernels_on_cuda_with_page_locked_buffers() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    assert check("cuda", pin=True) == 4


@pytest.mark.gpu
def test_one_compiled_staging_kernel_whatever_the_table_stride() -> None:
    """The overlapped decode's warm-up stages into a one-column scratch table (stride 1) and the
    passes into the KV table: a second specialisation would be compiled and loaded while a pass is
    in flight, the twelfth GPU session's hang. One kernel per BLOCK is all there may be."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from engine.model.decode_staging import _stage_kernel, stage_pass

    check("cuda", pin=True)  # n 1, 3, 8 (BLOCK 16) and 17 (BLOCK 32), table stride 40, page-locked host
    for stride in (1, 16, 33):
        for n in (1, 2):
            host = torch.zeros(2, n, dtype=torch.long).pin_memory()
            bufs = [torch.zeros(n + 3, dtype=torch.long, device="cuda")[3:] for _ in range(3)]  # unaligned
            stage_pass(host, torch.zeros(n, dtype=torch.long, device="cuda"), *bufs,
                       torch.zeros(n, dtype=torch.int32, device="cuda"),
                       torch.zeros(n, stride, dtype=torch.int32, device="cuda"))
    torch.cuda.synchronize()
    compiled = _stage_kernel.device_caches[torch.cuda.current_device()][0]
    assert len(compiled) == 2, list(compiled)


if __name__ == "__main__":  # the interpreter test's child
    assert check("cpu", pin=False) == 4
    print("ok")
