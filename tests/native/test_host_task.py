"""The split-layer entry points of the native executor: `skip_negative` (entries with id < 0 are
computed elsewhere) and `HostTask` (a prepared call with fixed buffers, as a CUDA host node runs
it). Both must give exactly what a call with only the kept entries gives."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from doorbell import doorbell_words, ring_and_wait, wait_word

from native.formats import ExpertWeights


def _bank(rows: int, hidden: int, inter: int, dtype: torch.dtype) -> ExpertWeights:
    g = torch.Generator().manual_seed(rows * 31 + hidden)
    w13 = (torch.randn(rows, 2 * inter, hidden, generator=g) * 0.1).to(dtype)
    w2 = (torch.randn(rows, hidden, inter, generator=g) * 0.1).to(dtype)
    return ExpertWeights("bf16" if dtype == torch.bfloat16 else "f32", w13, w2)


def _kept_only(ft, x, ids, weights, bank, offset):
    """The reference: each token's kept entries as a call of its own (weights of the skipped ones
    dropped, not zeroed)."""
    out = torch.zeros(x.shape, dtype=x.dtype)
    for t in range(x.shape[0]):
        keep = ids[t] >= 0
        if keep.any():
            out[t] = ft.moe_layer(x[t:t + 1], ids[t:t + 1, keep].contiguous(), weights[t:t + 1, keep].contiguous(),
                                  bank, None, offset)[0]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skip_negative_equals_a_call_with_the_kept_entries(ft, dtype):
    bank = _bank(12, 48, 40, dtype)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 48, generator=g).to(dtype)
    ids = torch.randint(0, 6, (5, 4), generator=g)
    ids[0] = -1  # a token with nothing on the CPU
    ids[1, 1:] = -1
    ids[3, 0] = -7
    w = torch.rand(5, 4, generator=g)
    out = ft.moe_layer(x, ids, w, bank, None, 6, skip_negative=True)
    assert torch.equal(out, _kept_only(ft, x, ids, w, bank, 6))
    assert torch.all(out[0] == 0)
    with pytest.raises(ValueError, match="out of range"):
        ft.moe_layer(x, ids, w, bank, None, 6)  # without the flag a negative id is an error


def test_host_task_runs_the_prepared_call_on_current_buffer_contents(ft):
    bank = _bank(8, 32, 24, torch.bfloat16)
    x = torch.zeros(3, 32, dtype=torch.bfloat16)
    ids = torch.zeros(3, 2, dtype=torch.int64)
    w = torch.zeros(3, 2)
    out = torch.full((3, 32), 7.0, dtype=torch.bfloat16)
    task = ft.HostTask(x, ids, w, bank, out, id_offset=4)
    g = torch.Generator().manual_seed(5)
    busy_before = ft.host_task_busy_ns()
    for _ in range(3):  # the buffers are refilled in place between runs, as the GPU copies do
        x.copy_(torch.randn(3, 32, generator=g))
        ids.copy_(torch.randint(-1, 4, (3, 2), generator=g))
        w.copy_(torch.rand(3, 2, generator=g))
        task.run()
        assert torch.equal(out, _kept_only(ft, x, ids, w, bank, 4))
    task.check()
    assert task.status()[:2] == (3, 0)
    assert ft.host_task_busy_ns() > busy_before  # the runs' time is counted (benchmarks report it)
    assert task.address != 0


def test_host_task_failure_is_reported_not_raised_and_zeroes_out(ft):
    bank = _bank(4, 32, 24, torch.float32)
    x = torch.randn(1, 32)
    ids = torch.tensor([[9, 0]])  # row 9 + offset 0 is outside the 4-row bank
    out = torch.ones(1, 32)
    task = ft.HostTask(x, ids, torch.ones(1, 2), bank, out)
    failures = ft.host_task_failures()
    task.run()
    assert torch.all(out == 0)
    with pytest.raises(RuntimeError, match="out of range"):
        task.check()
    assert ft.host_task_failures() == failures + 1  # the one counter the executor polls after each step
    assert task.status()[:2] == (1, 1)


def test_host_task_from_another_thread(ft):
    # a CUDA host node runs on the driver's thread, not the caller's
    bank = _bank(6, 32, 16, torch.float32)
    x, ids, w = torch.randn(2, 32), torch.tensor([[0, 5], [-1, 2]]), torch.rand(2, 2)
    out = torch.empty(2, 32)
    task = ft.HostTask(x, ids, w, bank, out)
    th = threading.Thread(target=task.run)
    th.start()
    th.join()
    task.check()
    assert torch.equal(out, _kept_only(ft, x, ids, w, bank, 0))


def test_host_task_checks_its_buffers(ft):
    bank = _bank(4, 32, 24, torch.float32)
    with pytest.raises(ValueError):
        ft.HostTask(torch.randn(2, 16), torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1), bank, torch.empty(2, 16))
    with pytest.raises(ValueError):
        ft.HostTask(torch.randn(2, 32), torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 1), bank, torch.empty(2, 32))


def test_doorbell_poller_runs_the_task_when_rung(ft):
    import time

    bank = _bank(6, 32, 16, torch.float32)
    x, ids, w = torch.randn(2, 32), torch.tensor([[0, 5], [-1, 2]]), torch.rand(2, 2)
    out = torch.zeros(2, 32)
    task = ft.HostTask(x, ids, w, bank, out)
    words = doorbell_words()  # page-locked on a GPU machine; plain memory works the same here
    task.serve_doorbell(words)
    served = ft.poll_served()
    for round_ in range(3):
        x.copy_(torch.randn(2, 32))
        assert ring_and_wait(words) and int(words[0]) == 0, round_
        assert torch.equal(out, _kept_only(ft, x, ids, w, bank, 0))
    assert ft.poll_served() - served == 3
    task.check()
    with pytest.raises(ValueError):
        task.serve_doorbell(words)
    del task  # unregisters before freeing: the poller must not touch it afterwards
    words[0] = 1
    time.sleep(0.01)
    assert int(words[0]) == 1


def _driver_present() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


@pytest.mark.skipif(_driver_present(), reason="the failure path needs a machine without the CUDA driver")
def test_host_issued_fetch_without_a_driver_fails_loudly_and_releases_the_gpu(ft):
    """The poller issues a task's fetch (native/src/dma_fetch.h) before its run;
    where the driver cannot be opened the fetch fails: the word the GPU would wait on is written
    from the host (nothing hangs), the CPU experts still run, and check() raises the reason. (The
    copies themselves: tests/engine/gpu_cache/test_device_step_cuda.py, on the GPU machine.)"""

    bank = _bank(6, 32, 16, torch.float32)
    x, ids, w = torch.randn(1, 32), torch.tensor([[1, 4]]), torch.rand(1, 2)
    out = torch.zeros(1, 32)
    task = ft.HostTask(x, ids, w, bank, out)
    copy = torch.tensor([3, -1, 0, 0], dtype=torch.int64)  # row 3 -> slot 0, then padding
    word = torch.zeros(1, dtype=torch.int32)
    ft._ext.host_task_set_fetch(task.address, copy.data_ptr(), 2, bank.w13.data_ptr(), bank.w2.data_ptr(), 0, 0,
                                bank.w13[0].numel() * 4, bank.w2[0].numel() * 4, 6, 1, 0, 0, word.data_ptr(),
                                5000, -1, 0, 0, 0, 0, 0, 0, 0)
    words = doorbell_words()
    task.serve_doorbell(words)
    assert ring_and_wait(words) and wait_word(word)  # the copier thread issues the fetch
    assert torch.equal(out, _kept_only(ft, x, ids, w, bank, 0))
    with pytest.raises(RuntimeError, match="libcuda"):
        task.check()


def test_serve_fetch_checks_its_buffers(ft):
    bank = _bank(6, 32, 16, torch.float32)
    task = ft.HostTask(torch.randn(1, 32), torch.zeros(1, 2, dtype=torch.int64), torch.ones(1, 2), bank,
                       torch.empty(1, 32))
    word = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="deadline_ms must be positive, got 0"):
        task.serve_fetch(torch.zeros(4, dtype=torch.int64), bank.w13, bank.w2, bank.w13, bank.w2, 0, 0, word,
                         deadline_ms=0)
    with pytest.raises(ValueError, match="page-locked int64"):  # not page-locked (and no CUDA here)
        task.serve_fetch(torch.zeros(4, dtype=torch.int64), bank.w13, bank.w2, bank.w13, bank.w2, 0, 0, word)
    words = torch.zeros(2, dtype=torch.int32)
    words.is_pinned = lambda: True  # type: ignore[method-assign]
    task.serve_doorbell(words)
    with pytest.raises(ValueError, match="before serve_doorbell"):
        task.serve_fetch(torch.zeros(4, dtype=torch.int64), bank.w13, bank.w2, bank.w13, bank.w2, 0, 0, word)


def test_doorbell_with_a_ready_word_counts_which_branch_finished_last(ft):
    """A 3-word doorbell: words[2] is the GPU's "my branch is done" word; each run counts the CPU
    late when it reads 1 there after the task, the GPU late when 0 (engine/gpu/adapt.py reads it)."""

    bank = _bank(6, 32, 16, torch.float32)
    task = ft.HostTask(torch.randn(1, 32), torch.tensor([[0, 5]]), torch.rand(1, 2), bank, torch.zeros(1, 32))
    words = doorbell_words(3)
    task.serve_doorbell(words)
    cpu0, gpu0 = ft.poll_lateness()
    for ready in (1, 0, 1):
        words[2] = ready  # what the GPU's stream writes before it waits for the answer
        assert ring_and_wait(words)
    cpu1, gpu1 = ft.poll_lateness()
    assert (cpu1 - cpu0, gpu1 - gpu0) == (2, 1)
    task.check()
    other = ft.HostTask(torch.randn(1, 32), torch.tensor([[0, 5]]), torch.rand(1, 2), bank, torch.zeros(1, 32))
    with pytest.raises(ValueError, match="2 or 3"):
        other.serve_doorbell(doorbell_words(4))


def test_timeline_counts_the_gpu_part_between_consecutive_layers_only(ft):
    """poll_timeline: every served doorbell adds the poller's time; an answer-to-doorbell interval
    counts as a gap only from one task to the next registered one (a step's layer l to l + 1),
    not from a task to itself or back to an earlier one (a new step, or anything between)."""
    bank = _bank(6, 32, 16, torch.float32)
    tasks, words = [], []
    for _ in range(2):  # layer 0, layer 1, registered in this order
        tasks.append(ft.HostTask(torch.randn(1, 32), torch.tensor([[0, 5]]), torch.rand(1, 2), bank,
                                 torch.zeros(1, 32)))
        words.append(doorbell_words())
        tasks[-1].serve_doorbell(words[-1])
    before = ft.poll_timeline()
    assert ring_and_wait(words[0])
    time.sleep(0.03)  # "the GPU's part" between layer 0's answer and layer 1's doorbell
    assert ring_and_wait(words[1])
    mid = ft.poll_timeline()
    assert ring_and_wait(words[1]) and ring_and_wait(words[0])  # 1 -> 1 and 1 -> 0: no gap
    after = ft.poll_timeline()
    d1 = {k: mid[k] - before[k] for k in mid}
    assert d1["served"] == 2 and d1["gaps"] == 1 and d1["cpu_ns"] > 0, d1
    assert 0.03e9 <= d1["gap_ns"] < 5e9, d1
    d2 = {k: after[k] - mid[k] for k in after}
    assert d2["served"] == 2 and d2["gaps"] == 0 and d2["gap_ns"] == 0 and d2["fetches"] == 0, d2
    for t in tasks:
        t.check()
