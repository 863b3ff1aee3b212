"""How `--gpu-memory` is split: dense weights, KV pages, recurrent-state slots, a workspace, and
what is left for expert slots.

Contract: `split_gpu_memory(total, cfg, opts, dtype, dense_bytes, expert_bytes)` returns a frozen
`GpuBudget` whose parts sum to at most `total`; it raises `ConfigError`, naming every part, when
the cap cannot hold the fixed parts plus one expert slot. `dense_bytes(weights, device)` counts the
dense tensors a decoder keeps on `device` (every tensor of the weights on it; the host expert banks
and a host embedding table are not; no device: every dense tensor).
The workspace reserve is an estimate of the activations of one prefill chunk (hidden states, the
attention and MoE intermediates, the Gated DeltaNet temporaries of hybrid models, logits of the
chunk's last tokens), the attention temporaries of the longest context the KV pool holds, and a
fixed margin for the allocator and CUDA graphs; the benchmarks report the measured peak next to
the cap.
`resolve_checkpoint_slots(opts, cfg, dtype)` sizes `checkpoint_slots` -1 (the default): 32, or
under a GPU cap as many state slots as fit in 1/16 of it (2 to 32).
`auto_gpu_memory(device)` is the cap when none is given: `auto_cap` of `device_memory(device)`, what
this process could use on the device (free memory plus what its allocator already holds), less
`auto_margin(total)` for other processes, the CUDA context and fragmentation; 0 off CUDA.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.cache.pools import KVPool, StatePool
from engine.config import ModelConfig
from engine.errors import ConfigError
from engine.options import EngineOptions
from engine.weights.layout import ExpertBanks

MARGIN = 256 * 2**20  # allocator fragmentation, cuBLAS workspaces, graph pools


def auto_margin(total: int) -> int:
    """What an automatic cap leaves of a device of `total` bytes: 5 %, at least 1 GiB."""
    return max(2**30, total // 20)


def device_memory(device: torch.device | str) -> tuple[int, int, int]:
    """(free, reserved by this process's allocator, total) bytes of a CUDA device."""
    device = torch.device(device)
    free, total = torch.cuda.mem_get_info(device)
    return free, torch.cuda.memory_reserved(device), total


def auto_cap(free: int, reserved: int, total: int) -> int:
    """What this process could use (free plus what its allocator already holds: its dense weights,
    when loaded first) less `auto_margin`; 0 when nothing would be left."""
    return max(0, free + reserved - auto_margin(total))


def auto_gpu_memory(device: torch.device | str) -> int:
    """The automatic `--gpu-memory`: `auto_cap` of the device now; 0 for a non-CUDA device."""
    return auto_cap(*device_memory(device)) if torch.device(device).type == "cuda" else 0


@dataclass(frozen=True)
class GpuBudget:
    total: int
    dense: int
    kv: int
    states: int
    workspace: int
    experts: int  # bytes for expert slots

    def describe(self) -> str:
        gib = 2**30
        return (f"{self.total / gib:.2f} GiB = dense {self.dense / gib:.2f} + KV {self.kv / gib:.2f} + states "
                f"{self.states / gib:.2f} + workspace {self.workspace / gib:.2f} + experts {self.experts / gib:.2f}")


def dense_bytes(obj: object, device: torch.device | None = None) -> int:
    """Bytes of every tensor reachable from a weights dataclass (on `device` when given), expert
    banks excluded; a tensor reachable twice (a tied LM head) counts once."""
    return sum(t.numel() * t.element_size() for t in _tensors(obj, {}).values()
               if device is None or t.device.type == device.type)


def _tensors(obj: object, seen: dict[tuple[int, int], torch.Tensor]) -> dict[tuple[int, int], torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        seen.setdefault((obj.data_ptr(), obj.numel() * obj.element_size()) if obj.numel() else (id(obj), 0), obj)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type) and not isinstance(obj, ExpertBanks):
        for f in dataclasses.fields(obj):
            _tensors(getattr(obj, f.name), seen)
    elif isinstance(obj, list | tuple):
        for x in obj:
            _tensors(x, seen)
    return seen


AUTO_CHECKPOINT_SLOTS = 32  # device checkpoint slots of an engine without a GPU cap
CHECKPOINT_SHARE = 16  # under a cap, device checkpoints take at most 1/16 of it
MIN_CHECKPOINT_SLOTS = 2


def resolve_checkpoint_slots(opts: EngineOptions, cfg: ModelConfig, dtype: torch.dtype,
                             cap: int | None = None) -> EngineOptions:
    """`opts` with `checkpoint_slots` -1 (the default) made a number: 32 without a GPU cap (`cap`,
    default `opts.gpu_memory`) or for a model without per-sequence state; under a cap, as many state
    slots as fit in 1/16 of it, between 2 and 32 (a Qwen3.6-35B-A3B state slot is 61.4 MiB: 12 slots
    at a 12 GiB cap, 1.2 GiB less than 32 would take). Any other value is returned as it is."""
    if opts.checkpoint_slots >= 0:
        return opts
    per_slot = StatePool.bytes_per_slot(cfg, dtype)
    cap = opts.gpu_memory if cap is None else cap
    n = AUTO_CHECKPOINT_SLOTS
    if cap and per_slot:
        n = max(MIN_CHECKPOINT_SLOTS, min(n, cap // CHECKPOINT_SHARE // per_slot))
    return dataclasses.replace(opts, checkpoint_slots=n)


def workspace_bytes(cfg: ModelConfig, opts: EngineOptions, dtype: torch.dtype) -> int:
    item = torch.empty(0, dtype=dtype).element_size()
    tokens = opts.prefill_chunk + opts.max_running
    # per token: a dozen hidden-sized activations, the q/k/v/gate projections and the routed experts'
    # gate/up outputs (k of them), all at once in the worst layer
    per_token = item * (12 * cfg.hidden_size + 4 * cfg.num_heads * cfg.head_dim
                        + 3 * cfg.top_k * cfg.moe_intermediate_size)
    logits = 4 * cfg.vocab_size * opts.max_running
    # attention over the longest context the KV pool can hold (engine/model/attention.py): the
    # gathered keys and values (twice: the rows, then with the chunk's) and their copies expanded to
    # every query head (three of them with sinks: expanded, padded with the sink key, transposed); a
    # causal lower-right bias, no mask (windowed layers attend over their ring only)
    context = opts.kv_tokens
    gathered = 4 * context * cfg.num_kv_heads * cfg.head_dim * item
    expanded = 2 * context * cfg.num_heads * (cfg.head_dim + (8 if cfg.attention_sinks else 0)) * item
    attention = gathered + expanded * (3 if cfg.attention_sinks else 1)
    return (tokens * per_token + logits + attention + linear_attention_bytes(cfg, opts, item)
            + grouped_prefill_bytes(cfg, opts, item) + MARGIN)


def grouped_prefill_bytes(cfg: ModelConfig, opts: EngineOptions, item: int) -> int:
    """The grouped prefill kernels' buffers (engine/gpu/grouped.py, the streamed prefill's kernels on
    CUDA): silu(gate) * up over the padded entry rows (at most N*k + 63 per expert), every entry's
    weighted output, their float32 per-token sum, and the int64 sort bookkeeping."""
    entries = opts.prefill_chunk * cfg.top_k
    rows = entries + cfg.num_experts * 63
    return (item * (rows * cfg.moe_intermediate_size + entries * cfg.hidden_size)
            + 4 * opts.prefill_chunk * cfg.hidden_size + 8 * 4 * rows)


def linear_attention_bytes(cfg: ModelConfig, opts: EngineOptions, item: int) -> int:
    """Gated DeltaNet temporaries of the worst layer (engine/model/linear_attention.py): per token the
    conv input and output, z and the core output in the model's dtype plus float32 copies of q, k
    (expanded to the value heads), v, g and beta; per chunk of 64 tokens a float32 state in fla's
    chunked kernel; per decode sequence eight float32 states (see below)."""
    if not cfg.linear_attention_layer_ids:
        return 0
    conv = 2 * cfg.linear_key_dim + cfg.linear_value_dim
    heads, state = cfg.linear_num_value_heads, cfg.linear_key_head_dim * cfg.linear_value_head_dim
    per_token = item * (2 * conv + 2 * cfg.linear_value_dim) + 4 * (3 * heads * cfg.linear_key_head_dim + 3 * heads)
    chunk_states = 2 * -(-opts.prefill_chunk // 64) * heads * state * 4
    # per decode sequence: the gathered, decayed, outer-product and updated states of recurrent_step
    # (4 float32 copies), doubled: with 4 the Qwen3.6 shape's captured decode peaked 7.7 MiB over a
    # 12 GiB cap on the H200 (one sequence; the captured pass keeps more of them alive at once)
    decode_states = 8 * opts.max_running * heads * state * 4
    return (opts.prefill_chunk + opts.max_running) * per_token + chunk_states + decode_states


def split_gpu_memory(total: int, cfg: ModelConfig, opts: EngineOptions, dtype: torch.dtype, dense: int,
                     expert_bytes: int) -> GpuBudget:
    opts = resolve_checkpoint_slots(opts, cfg, dtype, total)
    kv = KVPool.bytes_per_slot(cfg, dtype) * opts.kv_tokens
    states = StatePool.bytes_per_slot(cfg, dtype) * opts.device_state_slots
    work = workspace_bytes(cfg, opts, dtype)
    left = total - dense - kv - states - work
    if left < expert_bytes:
        gib = 2**30
        raise ConfigError(
            f"--gpu-memory {total / gib:.2f} GiB is too small: dense weights {dense / gib:.2f} + KV cache "
            f"{kv / gib:.2f} ({opts.kv_tokens} tokens) + states {states / gib:.2f} + workspace {work / gib:.2f} GiB "
            f"leave {max(left, 0) / gib:.2f} GiB, less than one expert ({expert_bytes / 2**20:.1f} MiB); "
            f"raise it or lower --kv-tokens")
    return GpuBudget(total, dense, kv, states, work, left)
