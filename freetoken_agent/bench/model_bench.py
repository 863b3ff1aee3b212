"""What `bench decode` and `bench prefill` share: their flags, an Engine on dummy (random) weights of
a real shape, cold caches, one timed request, the stored calibration, and the machine facts.

Contract:
- `add_model_arguments(p)`: the weights, one of --dummy (random weights of --shape / --layers, made
  in memory; every report says so) or --model PATH (a checkpoint), --seed, --device, the engine
  flags of `add_engine_arguments` (threads spelt --cpu-threads or --threads), --json.
- `ModelBench(args, kv_tokens, prefill_chunk)`: checks the arguments before any weight exists
  (`ConfigError`: no CUDA, --gpu-memory off CUDA, bad options; --device defaults to cuda when
  available), builds the decoder (engine/weights/dummy.py) and `Engine.from_decoder`, or loads the
  checkpoint with `Engine(path)`, with batch-1
  options: one running request, no recurrent-state checkpoints, `kv_tokens` KV slots. `close()`
  stops the engine.
- `ModelBench.cold()`: empties the prefix cache and, when the executor has an expert cache table,
  the expert cache. `timed_request(prompt, max_tokens[, temperature, seed]) -> Timing`: one request (greedy by default), timed on
  the engine thread (a listener): submit, first token, last token, with the executor's
  `CacheStats` (None without an expert cache) before submit, at the first token and at the end,
  and the generated ids.
- `calibration()` -> (the `Calibration` stored for this machine or None, note), from
  freetoken_agent/calibrate.py's file under engine/gpu/calibrate.py's key (GPU, CPU, executor
  threads, expert format and shape); `calibration_bandwidth(kind)` -> (GB/s or None, note): kind
  "both" is B_P' + B_C' (contended) on CUDA and B_C on a CPU engine, "stream" is B_P alone on
  CUDA and B_C on a CPU engine. None with an "unknown: ..." note when nothing usable is stored:
  never a guess.
- `facts()`: the machine and model facts every report carries (JSON-ready dict); `title()` the
  same in one line.
- `print_table(title, header, rows)`: a short rich table.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.errors import ConfigError
from engine.weights.shapes import MODEL_SHAPES, SHAPES
from freetoken_agent.argtypes import add_engine_arguments, engine_options, positive_int, resolve_gpu_memory

if TYPE_CHECKING:  # the engine (torch) is imported when a bench runs, not to define its parser
    from engine.moe.base import CacheStats, ExpertExecutor


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=MODEL_SHAPES, help="model shape (with --dummy)")
    p.add_argument("--layers", type=positive_int, default=None, help="layer count (default: the shape's)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--dummy", action="store_true", help="random weights of --shape, made in memory")
    source.add_argument("--model", default=None, metavar="PATH",
                        help="a checkpoint directory (config.json + safetensors) or a Qwen3-MoE / Qwen3.5-MoE .gguf file")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="compute device (default: cuda when available)")
    add_engine_arguments(p, threads_flags=("--cpu-threads", "--threads"))
    p.add_argument("--json", action="store_true", help="print one JSON object")


@dataclass
class Timing:
    submitted: float
    first: float  # perf_counter at the first token
    last: float  # perf_counter at the last token
    tokens: int
    stats_before: Any  # CacheStats, or None without an expert cache
    stats_first: Any
    stats_end: Any
    output: list[int]
    host_ns_first: int = 0  # native host-task time (the CPU branch of decode steps) at the first token
    host_ns_end: int = 0
    timeline_first: dict[str, int] | None = None  # the doorbell poller's sums (native poll_timeline)
    timeline_end: dict[str, int] | None = None


def _native_reading(name: str, default: Any) -> Any:
    """`native.ftnative.<name>()`, or `default` where the extension is not built."""
    try:
        from native import ftnative

        return getattr(ftnative, name)()
    except (ImportError, AttributeError, RuntimeError):
        return default


def host_task_ns() -> int:
    """The native CPU branch's time inside host tasks so far (0 where the extension is not built)."""
    return int(_native_reading("host_task_busy_ns", 0))


def poll_timeline() -> dict[str, int] | None:
    """The doorbell poller's sums so far (native `poll_timeline`); None where the extension is not built."""
    return _native_reading("poll_timeline", None)  # type: ignore[no-any-return]


def delta(a: Any, b: Any) -> dict[str, int] | None:
    """b - a of two CacheStats as {"hits", "misses", "fetched", "split"}; None without counters."""
    if a is None or b is None:
        return None
    return {k: getattr(b, k) - getattr(a, k) for k in ("hits", "misses", "fetched", "split")}


def median(values: list[float]) -> float:
    return float(statistics.median(values))


class ModelBench:
    def __init__(self, args: argparse.Namespace, kv_tokens: int, prefill_chunk: int) -> None:
        import torch

        from engine.engine import Engine
        from engine.model.load import parse_dtype
        from engine.weights.dummy import dummy_config, dummy_decoder
        from freetoken_agent.calibrate import calibration_path

        if args.device is None:
            args.device = "cuda" if torch.cuda.is_available() else "cpu"
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA device is available here (use --device cpu)")
        if args.gpu_memory and args.device != "cuda":
            raise ConfigError("--gpu-memory caps the GPU's memory: it needs --device cuda")
        args.gpu_memory = resolve_gpu_memory(args.gpu_memory, args.device)
        self.args, self.shape = args, SHAPES[args.shape]
        self.model = getattr(args, "model", None)
        if self.model is not None:
            from engine.config import ModelConfig

            path = Path(self.model)
            if args.layers is not None:
                raise ConfigError("--layers applies to --dummy shapes, not to a checkpoint")
            if path.suffix == ".gguf" and path.is_file():  # the peer's own file: the same weights for both
                from engine.weights.gguf_reader import GgufReader

                self.cfg = ModelConfig.from_dict(GgufReader(path).config(), source=str(path))
            elif (path / "config.json").is_file():
                self.cfg = ModelConfig.from_file(path / "config.json")
            else:
                raise ConfigError(f"--model {self.model}: no config.json there (nor a .gguf file)")
        else:
            self.cfg = dummy_config(self.shape, args.layers)
        if kv_tokens > self.cfg.max_position_embeddings:
            raise ConfigError(f"{kv_tokens} tokens exceed the shape's {self.cfg.max_position_embeddings} positions")
        self.opts = engine_options(args, device=args.device, kv_tokens=kv_tokens, max_running=1, checkpoint_slots=0,
                                   host_checkpoint_slots=0, prefill_chunk=prefill_chunk, gpu_memory=args.gpu_memory,
                                   calibration_file=str(calibration_path()))
        self.dtype = parse_dtype(self.opts.dtype or self.cfg.torch_dtype)
        self.device = torch.device(args.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.model is not None:
            self.note(f"loading {self.model} on {args.device}")
            t0 = time.perf_counter()
            self.engine = Engine(self.model, self.opts)
            self.load_s = time.perf_counter() - t0
            return
        expert_bytes, expert_format = self.dummy_expert_bytes()
        self.note(f"building random weights of {self.shape.name} ({self.cfg.num_layers} layers, "
                  f"{expert_bytes / 1e9:.1f} GB of {expert_format} experts, seed {args.seed}) on {args.device}")
        t0 = time.perf_counter()
        decoder = dummy_decoder(self.cfg, self.device, self.dtype, args.seed, self.opts.executor,
                                self.opts.native_pool_threads)
        self.engine = Engine.from_decoder(decoder, self.opts)
        self.load_s = time.perf_counter() - t0

    def dummy_expert_bytes(self) -> tuple[int, str]:
        """The random experts' bytes and their format, as built (engine/weights/dummy.py): gpt-oss's
        MXFP4, kept packed; every other family's in the engine dtype."""
        cfg = self.cfg
        if cfg.expert_layout == "gpt_oss":
            from engine.quant.formats import FORMATS

            h, i, mx = cfg.hidden_size, cfg.moe_intermediate_size, FORMATS["mxfp4"]
            return cfg.num_moe_layers * cfg.num_experts * (2 * i * mx.row_bytes(h) + h * mx.row_bytes(i)), "mxfp4"
        return self.shape.bank_bytes(cfg.num_moe_layers, self.dtype.itemsize), str(self.dtype).removeprefix("torch.")

    # ------------------------------------------------------------------ running
    def note(self, text: str) -> None:
        if not self.args.json:
            print(text, file=sys.stderr, flush=True)

    @property
    def executor(self) -> ExpertExecutor:
        return self.engine.decoder.executor

    def stats(self) -> CacheStats | None:
        return self.executor.stats

    def cold(self, experts: bool = True) -> None:
        """Empties the prefix cache and, with `experts`, the expert cache."""
        self.engine.reset_cache()  # returns once the engine is idle: nothing runs while the table resets
        from engine.gpu.executor import CachedExpertExecutor

        if experts and isinstance(self.executor, CachedExpertExecutor):
            self.executor.table.reset()

    def random_prompt(self, n: int, index: int) -> list[int]:
        import torch

        gen = torch.Generator().manual_seed(self.args.seed * 1_000_003 + index)
        return torch.randint(0, self.cfg.vocab_size, (n,), generator=gen).tolist()

    def timed_request(self, prompt: list[int], max_tokens: int, temperature: float = 0.0,
                      seed: int | None = None) -> Timing:
        from engine.sampling import SamplingParams

        marks: dict[str, Any] = {"count": 0}
        done = threading.Event()

        def listener(token: int | None) -> None:  # engine thread, between steps
            now = time.perf_counter()
            if token is None:
                marks["end"] = self.stats()
                marks["host_end"] = host_task_ns()
                marks["timeline_end"] = poll_timeline()
                done.set()
                return
            marks["count"] += 1
            marks["last"] = now
            if marks["count"] == 1:
                marks["first"] = now
                marks["first_stats"] = self.stats()
                marks["host_first"] = host_task_ns()
                marks["timeline_first"] = poll_timeline()

        before = self.stats()
        submitted = time.perf_counter()
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=temperature, seed=seed)
        handle = self.engine.submit(prompt, sampling, listener=listener)
        handle.result()
        done.wait()
        return Timing(submitted, marks["first"], marks["last"], marks["count"], before, marks["first_stats"],
                      marks["end"], list(handle.output_ids), marks["host_first"], marks["host_end"],
                      marks["timeline_first"], marks["timeline_end"])

    def close(self) -> None:
        self.engine.close()

    # ------------------------------------------------------------------ reporting
    def calibration(self) -> tuple[Any, str]:
        from engine.gpu.calibrate import CalibrationSpec, machine_key
        from engine.gpu.calibration_store import load
        from engine.moe.native import FORMAT_OF_DTYPE, load_native

        banks = self.engine.decoder.weights.experts
        try:
            threads = self.opts.native_pool_threads or load_native().physical_cores()
        except ConfigError as e:
            return None, f"unknown: {e}"
        spec = CalibrationSpec(fmt=FORMAT_OF_DTYPE.get(banks.w13.dtype, "bf16"), hidden=banks.w2.shape[1],
                               inter=banks.w2.shape[2], threads=threads, device=self.opts.device)
        key = machine_key(spec, threads, self.device.type == "cuda")
        cal = load(Path(self.opts.calibration_file), key)
        if cal is None:
            return None, (f"unknown: no calibration stored for {key.as_string()} (run `freetoken-agent calibrate "
                          f"--shape {self.shape.name} --threads {threads}`)")
        return cal, ""

    def calibration_bandwidth(self, kind: str) -> tuple[float | None, str]:
        cal, note = self.calibration()
        if cal is None:
            return None, note
        if self.device.type != "cuda":
            return cal.b_cpu, "B_C (CPU experts; no PCIe on a CPU engine)"
        if kind == "stream":
            if cal.b_pcie is None:
                return None, "unknown: the stored calibration has no B_P"
            return cal.b_pcie, "B_P (PCIe expert copies alone)"
        if cal.b_pcie_contended is None or cal.b_cpu_contended is None:
            return None, "unknown: the stored calibration has no contended B_P' / B_C'"
        return cal.b_pcie_contended + cal.b_cpu_contended, "B_P' + B_C' (contended)"

    def facts(self) -> dict[str, Any]:
        import torch

        from engine.cache.pools import KVPool
        from engine.gpu.budget import dense_bytes

        cuda = self.device.type == "cuda"
        cal, _ = self.calibration()
        banks = self.engine.decoder.weights.experts
        real = self.model is not None
        return {
            "weights": f"checkpoint {self.model}" if real else "dummy", "seed": self.args.seed,
            "routing": "the checkpoint's routers" if real else "random routers (near-uniform)",
            "shape": self.model if real else self.shape.name, "family": self.cfg.family, "layers": self.cfg.num_layers,
            "experts": self.cfg.num_experts, "top_k": self.cfg.top_k, "hidden": self.cfg.hidden_size,
            "expert_inter": self.cfg.moe_intermediate_size, "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device), "gpu": torch.cuda.get_device_name(self.device) if cuda else None,
            "cpu": _cpu_model(), "cpu_threads": _cpu_threads(self.opts.threads),
            "torch_threads": torch.get_num_threads(), "executor": self.executor.describe(),
            "gpu_memory": self.opts.gpu_memory or None,
            "gpu_budget": dataclasses.asdict(self.engine.gpu_budget) if self.engine.gpu_budget else None,
            "peak_gpu_bytes": torch.cuda.max_memory_allocated(self.device) if cuda else None,
            "expert_bytes": banks.expert_bytes, "expert_bank_bytes": banks.total_bytes,
            # per token over every layer: MLA's latent row, else the K and V heads (engine/cache/pools.py)
            "kv_bytes_per_token": KVPool.bytes_per_slot(self.cfg, self.dtype),
            "dense_bytes": dense_bytes(self.engine.decoder.weights, self.device), "load_s": round(self.load_s, 3),
            "calibration": cal.to_json() if cal is not None else None,
        }

    def title(self) -> str:
        f = self.facts()
        cap = f"{f['gpu_memory'] / 2**30:.1f} GiB cap" if f["gpu_memory"] else "no GPU cap"
        peak = f", peak {f['peak_gpu_bytes'] / 2**30:.2f} GiB" if f["peak_gpu_bytes"] is not None else ""
        weights = f"dummy weights seed {f['seed']}" if f["weights"] == "dummy" else f["weights"]
        return (f"{f['shape']} ({f['layers']} layers), {weights}, {f['device']}"
                f"{' ' + f['gpu'] if f['gpu'] else ''}, {cap}{peak}, {f['cpu_threads']} CPU threads; "
                f"experts: {f['executor']}")


def _cpu_model() -> str:
    from engine.gpu.calibrate import cpu_model

    return cpu_model()


def _cpu_threads(requested: int) -> int:
    """The CPU expert executor's pool size (the native one when built), else torch's threads."""
    import torch

    try:
        from engine.moe.native import load_native

        return int(load_native().num_threads())
    except ConfigError:
        return requested or torch.get_num_threads()


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) >= 100 else f"{value:.3g}"
    return str(value)


def print_table(title: str, header: list[str], rows: list[list[Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for col in header:
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(*(fmt(v) for v in row))
    Console(soft_wrap=False, width=None if sys.stdout.isatty() else 160).print(table)
