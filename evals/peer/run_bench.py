#!/usr/bin/env python3
"""Run llama.cpp's llama-bench (the peer) over a list of --n-cpu-moe values and summarise it.

Contract:
    python3 evals/peer/run_bench.py --model GGUF [--bench .peer/bin/llama-bench] [--ncmoe 24,16,12]
        [--threads 8] [--prompts 1024,4096,16384] [--gen 256] [--ubatch 2048] [--reps 3]
        [--ngl 99] [--fa 1] [--load-mode none] [--extra "ARGS"] [--out-dir DIR] [--timeout S]

- One llama-bench process per --ncmoe value (in the order given), each run as
  `llama-bench -m GGUF -ngl 99 -fa 1 -t THREADS -ncmoe N -p PROMPTS -n GEN -ub UBATCH -r REPS
  -lm none -o json` (the last flag is llama-bench's --load-mode: `none` reads the weights into
  llama.cpp's own host buffers, pinned for a CUDA build, instead of mmap'ing the file). Every flag is
  configurable; an empty value (e.g. `--ncmoe ''`, `--load-mode ''`, `--ngl ''`) leaves that flag
  out, and --extra appends raw arguments.
- While each process runs, a background thread samples the GPU's memory.used every --sample-ms
  (through NVML when the pynvml module is there, else `nvidia-smi --query-gpu=memory.used
  --format=csv,noheader,nounits` once per sample; --smi names that command, --gpu the device); the
  peak minus the reading taken just before the process started is reported as llama.cpp's peak GPU
  memory for that configuration (None when neither source works).
- Writes into --out-dir (default $OUT when set, else ./peer-bench): peer-bench.json (the summary:
  per ncmoe, prefill tok/s per prompt length with TTFT = n_prompt / prefill tok/s, decode tok/s,
  peak GPU memory, the command, and every raw llama-bench record) and peer-bench.log (llama-bench's
  stderr and stdout). Both are rewritten after every configuration, so a run cut short still leaves
  the finished ones. Prints a short table last. Exits non-zero if any llama-bench run failed or
  produced no results.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


class GpuMemSampler:
    """Peak GPU memory.used (MiB) while running, sampled every interval_ms in a background thread.

    Reads NVML (the `pynvml` module of nvidia-ml-py) when it is importable and answers, else runs
    `nvidia-smi --query-gpu=memory.used` once per sample; `available` is False when neither works.
    """

    def __init__(self, smi: str, gpu: int, interval_ms: int, use_nvml: bool = True) -> None:
        self.cmd = [smi, f"--id={gpu}", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
        self.interval_s = max(interval_ms, 1) / 1000.0
        self.peak: float | None = None
        self.samples = 0
        self._nvml: Any = None
        self._handle: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if use_nvml:
            try:
                import pynvml

                pynvml.nvmlInit()
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(gpu)
                pynvml.nvmlDeviceGetMemoryInfo(self._handle)
                self._nvml = pynvml
            except Exception:  # no module, no driver, no such GPU: fall back to nvidia-smi
                self._nvml, self._handle = None, None
        self.source = "nvml" if self._nvml is not None else ("nvidia-smi" if shutil.which(smi) else None)
        self.available = self.source is not None

    def read_once(self) -> float | None:
        if self._nvml is not None:
            try:
                return float(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used) / 2**20
            except Exception:
                return None
        if not self.available:
            return None
        try:
            out = subprocess.run(self.cmd, capture_output=True, text=True, timeout=30, check=True).stdout
            return float(out.strip().splitlines()[0])
        except (subprocess.SubprocessError, ValueError, IndexError, OSError):
            return None

    def _sample(self) -> None:
        v = self.read_once()
        if v is not None:
            self.samples += 1
            self.peak = v if self.peak is None else max(self.peak, v)

    def _loop(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(self.interval_s):
                return

    def start(self) -> None:
        self.peak, self.samples = None, 0
        if not self.available:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def stop(self) -> float | None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=60)
            self._thread = None
        return self.peak


def parse_bench_json(text: str) -> list[dict[str, Any]]:
    """llama-bench's `-o json` array; from a run cut short, every complete record before the cut."""
    try:
        data = json.loads(text)
        return [r for r in data if isinstance(r, dict)] if isinstance(data, list) else []
    except json.JSONDecodeError:
        pass
    records: list[dict[str, Any]] = []
    dec = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        return records
    i += 1
    while i < len(text):
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] != "{":
            break
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            break
        if isinstance(obj, dict):
            records.append(obj)
    return records


@dataclass
class ConfigResult:
    ncmoe: str
    command: list[str]
    returncode: int | None = None
    wall_s: float = 0.0
    gpu_mem_before_mib: float | None = None
    gpu_mem_peak_mib: float | None = None
    gpu_mem_samples: int = 0
    records: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        pp: dict[str, Any] = {}
        tg: dict[str, Any] = {}
        for r in self.records:
            n_p, n_g = int(r.get("n_prompt", 0)), int(r.get("n_gen", 0))
            ts = float(r.get("avg_ts", 0.0))
            entry = {"tok_s": ts, "stddev_tok_s": float(r.get("stddev_ts", 0.0)),
                     "samples_tok_s": r.get("samples_ts", []), "mean_s": float(r.get("avg_ns", 0)) / 1e9,
                     "n_depth": int(r.get("n_depth", 0))}
            if n_p > 0 and n_g == 0:
                entry["ttft_s"] = n_p / ts if ts > 0 else None
                pp[str(n_p)] = entry
            elif n_g > 0 and n_p == 0:
                entry["ms_per_token"] = 1000.0 / ts if ts > 0 else None
                tg[str(n_g)] = entry
            else:
                pp[f"{n_p}+{n_g}"] = entry
        first = self.records[0] if self.records else {}
        peak = (self.gpu_mem_peak_mib - self.gpu_mem_before_mib
                if self.gpu_mem_peak_mib is not None and self.gpu_mem_before_mib is not None else None)
        return {
            "ncmoe": self.ncmoe,
            "returncode": self.returncode,
            "wall_s": round(self.wall_s, 1),
            "gpu_mem_before_mib": self.gpu_mem_before_mib,
            "gpu_mem_peak_used_mib": self.gpu_mem_peak_mib,
            "gpu_mem_peak_mib": peak,
            "gpu_mem_samples": self.gpu_mem_samples,
            "prefill": pp,
            "decode": tg,
            "settings": {k: first.get(k) for k in ("n_cpu_moe", "n_gpu_layers", "n_threads", "n_batch", "n_ubatch",
                                                  "flash_attn", "load_mode", "type_k", "type_v")},
            "command": shlex.join(self.command),
        }


def bench_command(args: argparse.Namespace, ncmoe: str) -> list[str]:
    cmd = [str(args.bench), "-m", str(args.model)]

    def opt(flag: str, value: str) -> None:
        if value != "":
            cmd.extend([flag, value])

    opt("-ngl", args.ngl)
    opt("-fa", args.fa)
    opt("-t", args.threads)
    opt("-ncmoe", ncmoe)
    opt("-p", args.prompts)
    opt("-n", args.gen)
    opt("-ub", args.ubatch)
    opt("-b", args.batch)
    opt("-r", args.reps)
    opt("-lm", args.load_mode)
    cmd.extend(["-o", "json"])
    cmd.extend(shlex.split(args.extra))
    return cmd


def run_config(args: argparse.Namespace, ncmoe: str, sampler: GpuMemSampler, log: list[str]) -> ConfigResult:
    res = ConfigResult(ncmoe=ncmoe, command=bench_command(args, ncmoe))
    print(f"== run_bench: ncmoe={ncmoe or '-'}: {shlex.join(res.command)}", flush=True)
    res.gpu_mem_before_mib = sampler.read_once()
    sampler.start()
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(res.command, capture_output=True, text=True,
                              timeout=args.timeout if args.timeout > 0 else None)
        res.returncode, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        res.returncode = -9
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = (e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")) + \
            f"\nrun_bench: timed out after {args.timeout} s\n"
    res.wall_s = time.perf_counter() - t0
    res.gpu_mem_peak_mib = sampler.stop()
    res.gpu_mem_samples = sampler.samples
    res.records = parse_bench_json(out)
    log.append(f"===== ncmoe={ncmoe} rc={res.returncode} wall={res.wall_s:.1f}s\n$ {shlex.join(res.command)}\n"
               f"----- stderr\n{err}\n----- stdout\n{out}\n")
    if res.returncode != 0:
        print(f"run_bench: llama-bench exited {res.returncode}; stderr tail:\n{err[-3000:]}", file=sys.stderr)
    return res


def fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def table(summaries: list[dict[str, Any]]) -> str:
    prompts = sorted({int(k) for s in summaries for k in s["prefill"] if k.isdigit()})
    gens = sorted({int(k) for s in summaries for k in s["decode"]})
    head = ["ncmoe"] + [f"pp{p} t/s" for p in prompts] + [f"tg{g} t/s" for g in gens] + \
        [f"ttft{p} s" for p in prompts] + ["peak GPU MiB"]
    rows = [head]
    for s in summaries:
        pp, tg = s["prefill"], s["decode"]
        rows.append([s["ncmoe"] or "-"]
                    + [fmt(pp.get(str(p), {}).get("tok_s")) for p in prompts]
                    + [fmt(tg.get(str(g), {}).get("tok_s"), ".2f") for g in gens]
                    + [fmt(pp.get(str(p), {}).get("ttft_s"), ".3f") for p in prompts]
                    + [fmt(s["gpu_mem_peak_mib"], ".0f")])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", "-m", type=Path, required=True)
    p.add_argument("--bench", type=Path, default=REPO / ".peer" / "bin" / "llama-bench")
    p.add_argument("--ncmoe", default="24,16,12",
                   help="comma-separated --n-cpu-moe values, one llama-bench process each ('' = flag left out)")
    p.add_argument("--threads", "-t", default="8")
    p.add_argument("--prompts", "-p", default="1024,4096,16384")
    p.add_argument("--gen", "-n", default="256")
    p.add_argument("--ubatch", default="2048")
    p.add_argument("--batch", default="", help="-b (default: llama-bench's own, 2048)")
    p.add_argument("--reps", "-r", default="3")
    p.add_argument("--ngl", default="99")
    p.add_argument("--fa", default="1")
    p.add_argument("--load-mode", default="none", help="llama-bench -lm (auto|none|mmap|mlock|mmap+mlock|dio)")
    p.add_argument("--extra", default="", help="more llama-bench arguments, shell-quoted")
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--timeout", type=float, default=0, help="seconds per llama-bench process (0: none)")
    p.add_argument("--smi", default="nvidia-smi")
    p.add_argument("--gpu", type=int, default=0)
    p.add_argument("--sample-ms", type=int, default=100)
    p.add_argument("--no-nvml", action="store_true", help="sample through --smi even when pynvml is there")
    p.add_argument("--note", default="", help="free text stored in the summary (e.g. the GPU cap it mirrors)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.bench.is_file():
        print(f"run_bench: {args.bench} not found (run evals/peer/build.sh)", file=sys.stderr)
        return 2
    if not args.model.is_file():
        print(f"run_bench: {args.model} not found (write it with evals/peer/write_gguf.py)", file=sys.stderr)
        return 2
    out_dir = args.out_dir or (Path(os.environ["OUT"]) if os.environ.get("OUT") else Path("peer-bench"))
    out_dir.mkdir(parents=True, exist_ok=True)
    version_file = args.bench.parent / "PEER_VERSION"
    meta: dict[str, Any] = {
        "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "bench": str(args.bench),
        "peer_version": version_file.read_text() if version_file.is_file() else None,
        "model": str(args.model),
        "model_bytes": args.model.stat().st_size,
        "note": args.note,
    }
    sampler = GpuMemSampler(args.smi, args.gpu, args.sample_ms, use_nvml=not args.no_nvml)
    meta["gpu_mem_source"] = (f"{sampler.source} memory.used every {args.sample_ms} ms; peak while running minus "
                              "the reading before start") if sampler.available else None
    if not sampler.available:
        print(f"run_bench: neither NVML nor {args.smi} answers; peak GPU memory will be None", file=sys.stderr)
    ncmoes = [v.strip() for v in args.ncmoe.split(",")] if args.ncmoe.strip() else [""]
    results: list[ConfigResult] = []
    log: list[str] = []
    failed = False
    for ncmoe in ncmoes:
        res = run_config(args, ncmoe, sampler, log)
        results.append(res)
        failed |= res.returncode != 0 or not res.records
        summaries = [r.summary() for r in results]
        first = next((r.records[0] for r in results if r.records), {})
        meta.update({k: first.get(k) for k in ("build_commit", "build_number", "cpu_info", "gpu_info", "backends",
                                               "model_type", "model_size", "model_n_params")})
        doc = {"meta": meta, "configs": summaries, "raw": {r.ncmoe or "-": r.records for r in results}}
        (out_dir / "peer-bench.json").write_text(json.dumps(doc, indent=1))
        (out_dir / "peer-bench.log").write_text("".join(log))
        s = summaries[-1]
        print(f"   ncmoe={s['ncmoe'] or '-'} rc={s['returncode']} wall={s['wall_s']} s "
              f"peak GPU={fmt(s['gpu_mem_peak_mib'], '.0f')} MiB ({s['gpu_mem_samples']} samples) "
              f"records={len(res.records)}", flush=True)
    print(f"\nllama.cpp {meta.get('build_commit')} on {meta.get('gpu_info') or meta.get('cpu_info')}, "
          f"model {args.model.name} ({meta['model_bytes'] / 2**30:.2f} GiB), "
          f"-t {args.threads} -ngl {args.ngl or '-'} -fa {args.fa or '-'} -ub {args.ubatch or '-'} "
          f"-lm {args.load_mode or '-'} -r {args.reps or '-'}; results in {out_dir}")
    print(table([r.summary() for r in results]))
    if failed:
        print("run_bench: FAILED: at least one llama-bench run failed or produced no results", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
