"""The poller's host-issued fetch (native/src/dma_fetch.cpp) against a stand-in for the CUDA driver
(tests/native/fake_cuda.c, built here with the C compiler and found first on the library path of a
child process): for each copy-list entry with a bank row the two expert tensors' rows land in the
listed slot, padding is skipped, the word is set from the host once the task's stream has drained
(with the task's context made current), and through the doorbell the
poller hands the fetch to its copier thread and runs the layer's CPU experts meanwhile (a driver call
that blocks shows in `poll_copier_state`, and the word waits for it); an entry outside the banks or slots, or a copy the driver
refuses, fails the task (check() raises) and still writes the word, so the GPU's wait ends.
The same on a GPU: tests/engine/gpu_cache/test_device_step_cuda.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _child() -> None:
    import ctypes
    import time

    import torch
    from doorbell import doorbell_words, ring_and_wait, wait_word

    import native.ftnative as ft
    from native.formats import ExpertWeights

    fake = ctypes.CDLL("libcuda.so.1")  # the stand-in: the same library the native code opens
    fake.fake_ctx.restype = fake.fake_stream.restype = ctypes.c_void_p
    g = torch.Generator().manual_seed(3)
    rows, slots, hidden, inter = 6, 3, 32, 16
    w13 = torch.randn(rows, 2 * inter, hidden, generator=g)
    w2 = torch.randn(rows, hidden, inter, generator=g)
    bank = ExpertWeights("f32", w13, w2)
    s13 = torch.full((slots, 2 * inter, hidden), -1.0)
    s2 = torch.full((slots, hidden, inter), -1.0)
    x, ids, w = torch.randn(1, hidden, generator=g), torch.tensor([[1, 4]]), torch.rand(1, 2)
    out = torch.zeros(1, hidden)

    def task_with(copy: torch.Tensor, word: torch.Tensor, deadline_ms: int = 5000) -> ft.HostTask:
        task = ft.HostTask(x, ids, w, bank, out)
        ft._ext.host_task_set_fetch(task.address, copy.data_ptr(), copy.numel() // 2, w13.data_ptr(), w2.data_ptr(),
                                    s13.data_ptr(), s2.data_ptr(), w13[0].numel() * 4, w2[0].numel() * 4, rows,
                                    slots, 0xABC0, 0xC0DE, word.data_ptr(), deadline_ms, -1, 0, 0, 0, 0, 0, 0, 0)
        return task

    # direct: rows 5 -> slot 2, 0 -> slot 0, padding; the stream has drained at the first look
    copy = torch.tensor([5, -1, 0, 2, 0, 0], dtype=torch.int64)
    word = torch.zeros(1, dtype=torch.int32)
    task = task_with(copy, word)
    task.fetch()
    task.check()
    assert torch.equal(s13[2], w13[5]) and torch.equal(s2[2], w2[5])
    assert torch.equal(s13[0], w13[0]) and torch.equal(s2[0], w2[0])
    assert bool((s13[1] == -1).all()) and bool((s2[1] == -1).all())  # untouched
    assert int(word[0]) == 1 and fake.fake_copies() == 4
    assert fake.fake_ctx() == 0xC0DE and fake.fake_stream() == 0xABC0
    assert fake.fake_queries() == 1

    # the word set only once the stream has drained
    s13.fill_(-1.0)
    copy1 = torch.tensor([4, 1], dtype=torch.int64)
    word1 = torch.zeros(1, dtype=torch.int32)
    task1 = task_with(copy1, word1)
    fake.fake_pending(3)  # three "not ready" answers, then done
    task1.fetch()
    task1.check()
    assert torch.equal(s13[1], w13[4]) and int(word1[0]) == 1
    assert fake.fake_queries() == 1 + 4  # polled until drained

    # copies that never land (the stream never drains): after the deadline the task fails and the
    # word is released, so the GPU's wait ends and the step's check raises
    word6 = torch.zeros(1, dtype=torch.int32)
    copy6 = torch.tensor([1, 2], dtype=torch.int64)
    task6 = task_with(copy6, word6, deadline_ms=100)
    fake.fake_pending(1 << 30)
    t0 = time.monotonic()
    task6.fetch()
    waited = time.monotonic() - t0
    fake.fake_pending(0)
    assert int(word6[0]) == 1 and 0.1 <= waited < 5, waited
    try:
        task6.check()
        raise AssertionError("copies that never landed did not fail the task")
    except RuntimeError as e:
        assert "did not land within 100 ms" in str(e), str(e)

    # through the doorbell: the poller fetches, then runs the CPU experts
    s13.fill_(-1.0)
    copy2 = torch.tensor([3, 1], dtype=torch.int64)
    word2 = torch.zeros(1, dtype=torch.int32)
    task2 = task_with(copy2, word2)
    words = doorbell_words()
    task2.serve_doorbell(words)
    assert ring_and_wait(words) and wait_word(word2)  # the copier thread issued the fetch
    assert torch.equal(s13[1], w13[3])
    assert torch.equal(out, ft.moe_layer(x, ids, w, bank))
    task2.check()
    # the copier thread is started with the first fetching task; until it runs the poller fetches
    # itself (and a held copy would hold the poller too)
    deadline = time.monotonic() + 10
    while not ft.poll_copier_state()[0] and time.monotonic() < deadline:
        time.sleep(0.001)
    assert ft.poll_copier_state() == (True, False, False)

    # a driver call that blocks: the copier shows it is inside the fetch, and the word waits for it
    before = ft.poll_timeline()
    fake.fake_hold(1)
    try:  # released on failure too: the exit joins the copier
        s13.fill_(-1.0)
        word5 = torch.zeros(1, dtype=torch.int32)
        copy5 = torch.tensor([2, 0], dtype=torch.int64)  # kept alive: the task holds its address only
        task5 = task_with(copy5, word5)
        words5 = doorbell_words()
        task5.serve_doorbell(words5)
        assert ring_and_wait(words5)  # the CPU experts are answered while the copy is held
        deadline = time.monotonic() + 10
        while ft.poll_copier_state() != (True, False, True) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert ft.poll_copier_state() == (True, False, True) and int(word5[0]) == 0
        time.sleep(0.05)
    finally:
        fake.fake_hold(0)
    assert wait_word(word5) and torch.equal(s13[0], w13[2])
    deadline = time.monotonic() + 10
    while ft.poll_copier_state() != (True, False, False) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert ft.poll_copier_state() == (True, False, False)
    task5.check()
    # the timeline: one fetch, done after the poller's answer (late), held 50 ms or more
    after = ft.poll_timeline()
    d = {k: after[k] - before[k] for k in after}
    assert d["served"] == 1 and d["fetches"] == 1 and d["fetch_late"] == 1, d
    assert 0.05e9 <= d["fetch_ns"] < 10e9 and 0 < d["cpu_ns"] < d["fetch_ns"], d

    # an entry outside the slots: no copy, the task fails, the word is still written
    word3 = torch.zeros(1, dtype=torch.int32)
    copy3 = torch.tensor([2, slots], dtype=torch.int64)  # kept alive: the task holds its address only
    task3 = task_with(copy3, word3)
    before = fake.fake_copies()
    task3.fetch()
    assert int(word3[0]) == 1 and fake.fake_copies() == before
    try:
        task3.check()
        raise AssertionError("an out-of-range copy did not fail the task")
    except RuntimeError as e:
        assert "outside the banks / slots" in str(e)

    # the driver refuses a copy: the task fails with the driver's error, the word is written
    fake.fake_fail_copy_at(fake.fake_copies())
    word4 = torch.zeros(1, dtype=torch.int32)
    copy4 = torch.tensor([1, 0], dtype=torch.int64)
    task4 = task_with(copy4, word4)
    task4.fetch()
    assert int(word4[0]) == 1
    try:
        task4.check()
        raise AssertionError("a refused copy did not fail the task")
    except RuntimeError as e:
        assert "error 700" in str(e), str(e)

    # the split expert: with the copy list its first r intermediate rows land in the scratch slot
    # (gate rows [0, r), up rows [I, I + r), w2's columns [0, r) by a pitched copy), the rest of the
    # scratch untouched; the task's CPU run computes that expert's rows [r, I), and the two parts add
    # up to the whole expert
    fake.fake_fail_copy_at(-1)
    split_inter = 32
    sw13 = torch.randn(rows, 2 * split_inter, hidden, generator=g)
    sw2 = torch.randn(rows, hidden, split_inter, generator=g)
    sbank = ExpertWeights("f32", sw13, sw2)
    t13 = torch.full((slots + 1, 2 * split_inter, hidden), -1.0)
    t2 = torch.full((slots + 1, hidden, split_inter), -1.0)
    sx, sids, sw = torch.randn(1, hidden, generator=g), torch.tensor([[2, 4]]), torch.rand(1, 2)
    sout = torch.zeros(1, hidden)
    r = 16
    copy7 = torch.tensor([1, -1, 0, -1, 4, r], dtype=torch.int64)  # row 1 -> slot 0; split: row 4, r rows
    word7 = torch.zeros(1, dtype=torch.int32)
    task7 = ft.HostTask(sx, sids, sw, sbank, sout)
    ft._ext.host_task_set_fetch(task7.address, copy7.data_ptr(), 2, sw13.data_ptr(), sw2.data_ptr(), t13.data_ptr(),
                                t2.data_ptr(), sw13[0].numel() * 4, sw2[0].numel() * 4, rows, slots, 0xABC0, 0xC0DE,
                                word7.data_ptr(), 5000, slots, split_inter, hidden, 4, 0, 0, 0, 0)
    task7.fetch()
    task7.check()
    sc = slots  # the scratch slot
    assert torch.equal(t13[0], sw13[1]) and torch.equal(t2[0], sw2[1])
    assert torch.equal(t13[sc, :r], sw13[4, :r]) and torch.equal(t13[sc, split_inter:split_inter + r],
                                                                 sw13[4, split_inter:split_inter + r])
    assert bool((t13[sc, r:split_inter] == -1).all()) and bool((t13[sc, split_inter + r:] == -1).all())
    assert torch.equal(t2[sc, :, :r], sw2[4, :, :r]) and bool((t2[sc, :, r:] == -1).all())
    task7.run()
    task7.check()
    gpu_part = torch.zeros(1, hidden)  # what the GPU adds: expert 4's rows [0, r), weighted
    gate, up = sx @ sw13[4, :r].T, sx @ sw13[4, split_inter:split_inter + r].T
    gpu_part += sw[0, 1] * ((torch.nn.functional.silu(gate) * up) @ sw2[4, :, :r].T)
    whole = ft.moe_layer(sx, sids, sw, sbank)
    assert torch.allclose(sout + gpu_part, whole, atol=1e-4, rtol=1e-4), (sout + gpu_part - whole).abs().max()
    assert not torch.allclose(sout, whole, atol=1e-3)  # the CPU computed only its share
    # a split entry outside the banks, or with r outside (0, I): no copy, the task fails, the word is written
    for bad in ((rows, r), (4, 0), (4, split_inter)):
        copy9 = torch.tensor([-1, -1, *bad], dtype=torch.int64)
        word9 = torch.zeros(1, dtype=torch.int32)
        task9 = ft.HostTask(sx, sids, sw, sbank, sout)
        ft._ext.host_task_set_fetch(task9.address, copy9.data_ptr(), 1, sw13.data_ptr(), sw2.data_ptr(),
                                    t13.data_ptr(), t2.data_ptr(), sw13[0].numel() * 4, sw2[0].numel() * 4, rows,
                                    slots, 0xABC0, 0xC0DE, word9.data_ptr(), 5000, slots,
                                    split_inter, hidden, 4, 0, 0, 0, 0)
        before = fake.fake_copies()
        task9.fetch()
        assert int(word9[0]) == 1 and fake.fake_copies() == before, bad
        try:
            task9.check()
            raise AssertionError(f"a bad split entry {bad} did not fail the task")
        except RuntimeError as e:
            assert "split entry" in str(e), str(e)
    # a copy list that names the scratch slot as a table slot is refused
    copy8 = torch.tensor([1, slots, -1, 0], dtype=torch.int64)
    word8 = torch.zeros(1, dtype=torch.int32)
    task8 = ft.HostTask(sx, sids, sw, sbank, sout)
    ft._ext.host_task_set_fetch(task8.address, copy8.data_ptr(), 1, sw13.data_ptr(), sw2.data_ptr(), t13.data_ptr(),
                                t2.data_ptr(), sw13[0].numel() * 4, sw2[0].numel() * 4, rows, slots, 0xABC0, 0xC0DE,
                                word8.data_ptr(), 5000, slots, split_inter, hidden, 4, 0, 0, 0, 0)
    task8.fetch()
    assert int(word8[0]) == 1
    try:
        task8.check()
        raise AssertionError("a copy into the scratch slot did not fail the task")
    except RuntimeError as e:
        assert "outside the banks / slots" in str(e), str(e)
    print("ok")


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="needs a C compiler")
def test_host_issued_fetch_against_a_stand_in_driver(tmp_path: Path, ft) -> None:  # type: ignore[no-untyped-def]
    cc = shutil.which("cc") or shutil.which("gcc")
    lib = tmp_path / "libcuda.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", str(HERE / "fake_cuda.c"), "-o", str(lib)], check=True)
    env = {**os.environ, "LD_LIBRARY_PATH": f"{tmp_path}:{os.environ.get('LD_LIBRARY_PATH', '')}",
           "PYTHONPATH": os.pathsep.join([str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr


if __name__ == "__main__":
    _child()
