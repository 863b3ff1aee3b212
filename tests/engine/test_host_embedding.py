"""The token embedding in page-locked host memory (engine/gpu/setup.py `host_embedding`, engine/model/ops.py
`embed_tokens`, engine/gpu/host_rows.py `gather_rows`):
- `gather_rows` returns exactly F.embedding's rows for ids of any shape, hidden sizes that are not a
  power of two or span several programs, and a zero row (never a read outside the table) for an id out
  of range; on CUDA from a pinned host table, also replayed from a CUDA graph with new ids; on a CPU
  through Triton's interpreter, when triton is installed;
- `host_embedding` moves an untied table into pinned host memory and leaves one tied to the LM head;
- `dense_bytes` counts a tied LM head once and, given a device, only the tensors on it.
The capped engine with its table on the host generating what the uncapped engine generates is
tests/engine/gpu_cache/test_gpu_memory_cuda.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import run_in_interpreter

from engine.gpu.budget import dense_bytes


def check(table_device: str, ids_device: str) -> int:
    from engine.gpu.host_rows import gather_rows

    cases = 0
    g = torch.Generator().manual_seed(7)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for vocab, hidden in ((50, 96), (300, 2048), (7, 1500)):
            table = torch.randn(vocab, hidden, generator=g).to(dtype)
            host = table.to(table_device)
            if table_device == "cpu" and ids_device == "cuda":
                host = host.pin_memory()
            for shape in ((1,), (5,), (2, 3)):
                ids = torch.randint(0, vocab, shape, generator=g)
                got = gather_rows(ids.to(ids_device), host)
                assert got.shape == (*shape, hidden) and got.device.type == ids_device and got.dtype == dtype
                assert torch.equal(got.cpu(), F.embedding(ids, table)), (dtype, vocab, hidden, shape)
                cases += 1
            bad = torch.tensor([vocab, -1, 0])
            got = gather_rows(bad.to(ids_device), host).cpu()
            assert torch.equal(got[:2], torch.zeros(2, hidden, dtype=dtype)) and torch.equal(got[2], table[0])
    return cases


def test_dense_bytes_counts_a_tied_head_once_and_filters_by_device() -> None:
    head = torch.zeros(10, 4)
    from engine.weights.layout import DecoderWeights, ExpertBanks

    banks = ExpertBanks(w13=torch.zeros(2, 6, 4), w2=torch.zeros(2, 4, 3), num_experts=2)
    tied = DecoderWeights(embed=head, final_norm=torch.zeros(4), lm_head=head, layers=[], experts=banks)
    untied = DecoderWeights(embed=torch.zeros(10, 4), final_norm=torch.zeros(4), lm_head=head, layers=[],
                            experts=banks)
    assert dense_bytes(tied) == (40 + 4) * 4
    assert dense_bytes(untied) == (40 + 40 + 4) * 4
    assert dense_bytes(untied, torch.device("cpu")) == dense_bytes(untied)
    assert dense_bytes(untied, torch.device("cuda")) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gather_rows_from_pinned_host_table_cuda() -> None:
    assert check("cpu", "cuda") == 27
    from engine.gpu.host_rows import gather_rows

    table = torch.randn(1000, 2048).bfloat16().pin_memory()
    ids = torch.zeros(4, dtype=torch.long, device="cuda")
    gather_rows(ids, table)  # compile before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gather_rows(ids, table)
    for new in ([3, 999, 0, 3], [17, 5, 500, 2]):
        ids.copy_(torch.tensor(new))
        graph.replay()
        assert torch.equal(out.cpu(), table[torch.tensor(new)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_embedding_moves_an_untied_table_and_keeps_a_tied_one() -> None:
    from engine.gpu.setup import host_embedding

    embed = torch.randn(100, 64, device="cuda")
    head = torch.randn(100, 64, device="cuda")
    want = embed.cpu()
    untied = SimpleNamespace(weights=SimpleNamespace(embed=embed, lm_head=head))
    assert host_embedding(untied) == 100 * 64 * 4  # type: ignore[arg-type]
    moved = untied.weights.embed
    assert moved.device.type == "cpu" and moved.is_pinned() and torch.equal(moved, want)
    assert host_embedding(untied) == 0  # type: ignore[arg-type]  # already on the host
    tied = SimpleNamespace(weights=SimpleNamespace(embed=head, lm_head=head))
    assert host_embedding(tied) == 0  # type: ignore[arg-type]
    assert tied.weights.embed is head


def test_gather_rows_in_triton_interpreter() -> None:
    run_in_interpreter(__file__)


if __name__ == "__main__":  # the interpreter test's child
    assert check("cpu", "cpu") == 27
    print("ok")
