"""Where the host-issued fetch stops: the seventh GPU session saw
`CachedExpertExecutor` device steps hang for good on the H200 when a layer refilled every slot the
previous layer had just filled (3 slots, ratio 1.0, eager; 3 slots, ratio 0.5, captured), with the
poller's answer written, the layer's fetched word still 0 and no failure recorded; 20 slots ran
through. The copier then set the word by a stream write queued after its copies: a wait on
another stream's work that CUDA cannot see, which the driver's documentation warns may deadlock.
Since then the word is written by the host (the copier polls its stream until the copies have
landed, then stores 1, as the poller answers); the stream-written word is gone from the engine.
Each case runs in a child process under one environment and a watchdog; on a hang the child
prints the per-layer words, whether the copy stream is idle, the copier's state and every
thread's stack (a blocking read: the device is stuck; a launch: the driver), then exits.

Variants, one hypothesis each (the eighth session also ran the stream-written word: plain, with
CUDA_MODULE_LOADING=EAGER, with CUDA_DEVICE_MAX_CONNECTIONS=32 and polled; see below):
- host-word: a blocking read of the counters after each layer;
- host-word, eager-modules: CUDA_MODULE_LOADING=EAGER (a kernel loaded lazily while the stream
  waits may need the device idle under the driver's lock, which the copier's calls then need);
- host-word, polled: the engine's way (the host reads only after the step is done).
- host-word, pinned read: the step's counters copied asynchronously into page-locked memory while
  the step may still wait for the copier, then an event polled: what queueing the next step before
  reading this one's picks needs (the tenth session's idea against the host time between steps).

With the host-written word, copies that never land fail the fetch after 5 s (FAILED, not HANG).
Found in the eighth session (before host-word, polled existed): host-word and stream-word hung
alike; stream-word, polled ran every case. The child's `ex._counts.tolist()` after each layer reads device memory into pageable
memory while the step still waits for the copier: that read holds a driver lock until the GPU is
done, and the copier's cuMemcpyHtoDAsync needs it (the copier is stuck inside the driver, so the
deadline cannot end it). docs/gpu-tier.md states the rule the engine keeps.
Usage on the GPU machine: python -m evals.gpu.dma_hang_probe [--watchdog-s 8]. Prints a table."""

from __future__ import annotations

import argparse
import faulthandler
import os
import re
import subprocess
import sys
import threading
import time

CASES = ((3, 1.0, False), (3, 0.5, True), (20, 1.0, False))
VARIANTS = {
    "host-word": {},
    "host-word, eager-modules": {"CUDA_MODULE_LOADING": "EAGER"},
    "host-word, polled": {"FT_PROBE_POLLED": "1"},
    "host-word, pinned read": {"FT_PROBE_READ": "pinned"},
}
L, E, K, H, INTER = 3, 16, 4, 256, 96  # tests/engine/gpu_cache/test_device_step_cuda.py's sizes


def child(slots: int, ratio: float, graphs: bool, watchdog_s: float) -> None:
    import torch

    from engine.gpu.executor import create_cached_executor
    from engine.gpu.setup import pin_in_place
    from engine.weights.layout import ExpertBanks
    from native.ftnative import poll_copier_state, poll_served

    g = torch.Generator().manual_seed(0)
    banks = ExpertBanks((torch.randn(L * E, 2 * INTER, H, generator=g) / 8).bfloat16(),
                        (torch.randn(L * E, H, INTER, generator=g) / 6).bfloat16(), E)
    assert pin_in_place(banks)
    ex = create_cached_executor(banks, slots * banks.expert_bytes, "cuda", ratio, graphs=graphs)
    where = {"step": -1, "layer": -1}
    polled = os.environ.get("FT_PROBE_POLLED") == "1"
    pinned = (torch.zeros(ex._counts.shape, dtype=ex._counts.dtype, pin_memory=True)
              if os.environ.get("FT_PROBE_READ") == "pinned" else None)

    def watchdog() -> None:
        time.sleep(watchdog_s)
        up, pending, copying = poll_copier_state()
        print(f"HANG step {where['step']} layer {where['layer']} served {poll_served()} "
              f"copier up {up} pending {pending} copying {copying}")
        for tokens, step in ex._steps.items():
            for layer in step._tasks:
                print(f"  tokens {tokens} layer {layer}: fetched word {step._fetched[layer][0].tolist()} "
                      f"doorbell {step._doorbells[layer][0].tolist()}")
            print(f"  tokens {tokens}: copy stream idle {step.copy_stream.query()} copy list {step.copy_h.tolist()}")
        sys.stdout.flush()
        # where the main thread waits: a blocking read (the device is stuck) or a launch (the driver)
        faulthandler.dump_traceback(file=sys.stdout, all_threads=True)
        sys.stdout.flush()
        os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    try:
        for s in range(9):
            n = 4 if s % 3 == 2 else 1
            gs = torch.Generator().manual_seed(1000 + s)
            ids = torch.stack([torch.randperm(E, generator=gs)[:K] for _ in range(n)]).cuda()
            x = torch.randn(n, H, generator=gs).bfloat16().cuda()
            w = torch.rand(n, K, generator=gs).bfloat16().cuda()
            for layer in range(L):
                where.update(step=s, layer=layer)
                ex(x, ids, w, layer)
                if polled:
                    done = torch.cuda.Event()
                    done.record()
                    while not done.query():
                        time.sleep(50e-6)
                if pinned is not None:  # an async read into page-locked memory, then an event
                    pinned.copy_(ex._counts, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record()
                    while not done.query():
                        time.sleep(50e-6)
                else:
                    ex._counts.tolist()
                ex.check()  # a failed fetch raises at the layer it failed
    except Exception as e:  # a fetch that failed (the host-written word's deadline) is reported, not hung
        print(f"FAILED step {where['step']} layer {where['layer']}: {e}")
        sys.stdout.flush()
        os._exit(4)
    print("OK")
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--watchdog-s", type=float, default=8.0)  # past the host word's 5 s deadline
    ap.add_argument("--only", default="", help="run the variants whose name matches this regex")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        slots, ratio, graphs = args.child
        child(int(slots), float(ratio), graphs == "1", args.watchdog_s)
        return
    rows = []
    for variant, env in VARIANTS.items():
        if not re.search(args.only, variant):
            continue
        for slots, ratio, graphs in CASES:
            cmd = [sys.executable, "-m", "evals.gpu.dma_hang_probe", "--watchdog-s", str(args.watchdog_s),
                   "--child", str(slots), str(ratio), "1" if graphs else "0"]
            err = ""
            try:
                proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True,
                                      timeout=args.watchdog_s + 60)
                out, err = proc.stdout, proc.stderr
            except subprocess.TimeoutExpired:
                out = "TIMEOUT (watchdog did not fire)"
            lines = [ln for ln in out.splitlines() if ln.startswith(("OK", "HANG", "FAILED", "  ", "TIMEOUT", "Thread", "Current"))]
            print(f"== {variant} slots {slots} ratio {ratio} graphs {graphs}\n" + "\n".join(lines), flush=True)
            crash = next((ln for ln in reversed(err.splitlines()) if ln.strip()), "")
            result = next((ln for ln in lines if ln.startswith(("OK", "HANG", "FAILED", "TIMEOUT"))),
                          f"no result: {crash}")
            idle = [ln.split("copy stream idle ")[1].split()[0] for ln in lines if "copy stream idle" in ln]
            rows.append((variant, slots, ratio, graphs, result.replace("|", "/"), ",".join(idle)))
    print("| variant | slots | ratio | graphs | result | copy streams idle |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")


if __name__ == "__main__":
    main()
