"""Run a test module's kernel checks under Triton's interpreter, on the CPU: the module is run as a
script (`__name__ == "__main__"`, `sys.argv[1:]` the arguments given) with TRITON_INTERPRET=1 (read when kernels are defined, hence a
child process) and must print "ok" last. Skips when triton is not installed; on the GPU machine it
runs too.

One child serves the whole session (torch, triton and transformers are imported once, not once per
module): each call sends it a script path and it answers with the script's output and whether it
raised. Before each script the child resets what a fresh process would have (the script's folder
first on `sys.path`, torch's default seed, a new `__main__` namespace). A child that dies or takes
longer than the timeout fails that test and is replaced for the next one."""

from __future__ import annotations

import atexit
import json
import os
import selectors
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 600.0

# The child: requests are script paths with their arguments on stdin, one JSON object a line; each answer is one JSON line on the
# protocol fd (the original stdout). fd 1 and 2 go to a log file, so C-level output cannot break the
# protocol; the script's Python-level output is captured per request.
_WORKER = r"""
import contextlib, io, json, os, runpy, sys, traceback
proto = os.fdopen(os.dup(1), "w")
log = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
os.dup2(log, 1)
os.dup2(log, 2)
import torch
base_path = list(sys.path)
for line in sys.stdin:
    request = json.loads(line)
    script = request["script"]
    sys.argv = [script, *request["argv"]]
    out = io.StringIO()
    ok = True
    sys.path[:] = [os.path.dirname(script), *base_path]
    torch.manual_seed(67280421310721)  # torch's seed in a fresh process
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            runpy.run_path(script, run_name="__main__")
        except BaseException:
            ok = False
            traceback.print_exc()
    proto.write(json.dumps({"ok": ok, "output": out.getvalue()}) + "\n")
    proto.flush()
"""


class _Worker:
    def __init__(self) -> None:
        env = {**os.environ, "TRITON_INTERPRET": "1",
               "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path[1:]])}
        fd, self.log_path = tempfile.mkstemp(prefix="triton-interpreter-", suffix=".log")
        os.close(fd)
        self.proc = subprocess.Popen([sys.executable, "-c", _WORKER, self.log_path], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)

    def log_tail(self) -> str:
        return Path(self.log_path).read_text(errors="replace")[-4000:]

    def run(self, script: str, argv: list[str], timeout: float) -> dict[str, Any] | None:
        """The script's answer, or None when the child died or did not answer in time."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps({"script": script, "argv": argv}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            return None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            line = self.proc.stdout.readline() if sel.select(timeout) else ""
        return dict(json.loads(line)) if line else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        Path(self.log_path).unlink(missing_ok=True)


_worker: _Worker | None = None


def _stop_worker() -> None:
    if _worker is not None:
        _worker.stop()


atexit.register(_stop_worker)


def run_in_interpreter(script: str, *argv: str) -> None:
    global _worker
    pytest.importorskip("triton")
    if _worker is None or _worker.proc.poll() is not None:
        _worker = _Worker()
    worker = _worker
    answer = worker.run(str(Path(script).resolve()), list(argv), TIMEOUT_S)
    if answer is None:
        log = worker.log_tail()
        worker.stop()
        _worker = None
        pytest.fail(f"the interpreter child died or took over {TIMEOUT_S:.0f} s on {script}:\n{log}")
    output = answer["output"]
    assert answer["ok"] and output.strip().endswith("ok"), output[-6000:]
