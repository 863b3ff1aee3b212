"""engine/gpu/load_guard.py: a Triton kernel first launched while the device waits for a host
thread completes once the guard is installed.

The GPU test rebuilds the twelfth GPU session's deadlock in a child process (a hang costs its
timeout, not the suite): the stream waits on a page-locked word (`wait_done`, as a MoE layer waits
for the host-issued copies), a helper thread does driver work (a copy) and then sets the word, and
meanwhile the main thread launches a Triton kernel this process has never loaded. With the guard
the load waits for the device, the helper gets through and everything finishes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.gpu import load_guard

CHILD = r"""
import threading, time, sys
import torch, triton, triton.language as tl
from engine.gpu import load_guard
from engine.gpu.host_fn import device_address, wait_done

assert load_guard.install()


@triton.jit
def _fresh(x_ptr, SALT: tl.constexpr):
    tl.store(x_ptr, tl.load(x_ptr) + SALT)


word = torch.zeros(1, dtype=torch.int32, pin_memory=True)
x = torch.zeros(1, device="cuda")
src = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
dst = torch.zeros(1 << 20, dtype=torch.float32, pin_memory=True)  # page-locked, as the fetch's banks:
torch.cuda.synchronize()  # a pageable copy would wait for the main stream itself (dma_hang_probe)
side = torch.cuda.Stream()


def answer():
    time.sleep(0.5)
    with torch.cuda.stream(side):
        dst.copy_(src, non_blocking=True)  # driver work while the main stream waits
    side.synchronize()
    assert dst[-1].item() == (1 << 20) - 1
    word[0] = 1


before = load_guard.loads_seen()
wait_done(torch.cuda.current_stream(), device_address(word))
helper = threading.Thread(target=answer)
helper.start()
_fresh[(1,)](x, SALT=3)  # compiled (or read from Triton's cache) and loaded now, for the first time
torch.cuda.synchronize()
helper.join()
assert x.item() == 3.0 and load_guard.loads_seen() > before
print("finished")
"""


def test_install_adds_the_hook_once() -> None:
    from triton import knobs

    assert load_guard.install() and load_guard.install()
    assert knobs.runtime.kernel_load_start_hook.calls.count(load_guard.settle_before_load) == 1
    seen = load_guard.loads_seen()
    load_guard.settle_before_load(None, None, "k", {}, "h")  # off CUDA (or idle): returns at once
    assert load_guard.loads_seen() == seen + 1


@pytest.mark.gpu
def test_a_first_load_while_the_device_waits_for_a_host_thread_finishes(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    child = tmp_path / "load_during_wait.py"  # a file: Triton reads a kernel's source with inspect
    child.write_text(CHILD)
    try:
        proc = subprocess.run([sys.executable, str(child)], env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the kernel load deadlocked with the device waiting for the host (guard ineffective)")
    assert proc.returncode == 0 and "finished" in proc.stdout, proc.stderr[-2000:]
