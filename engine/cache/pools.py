"""Pre-allocated KV and per-sequence state pools (recurrent states, sliding-window rings).

Contract:
- `KVPool`: per full-attention layer (not the sliding-window ones: their rings are state below),
  key and value tensors [num_slots, heads, dim] of the shapes `cfg.kv_slot_shapes` gives (GQA:
  kv_heads x head_dim each; MLA: one latent row of kv_lora_rank + qk_rope_head_dim as the key, an
  empty value); one slot holds one token (page size 1, so the radix tree can share any prefix).
  `alloc(n)` returns n free slot ids or None when the pool is short; `free(slots)` returns them.
- `StatePool`: per Gated DeltaNet layer, conv windows [num_slots, C, K-1] (model dtype) and SSM
  states [num_slots, Hv, dk, dv] (float32); per sliding-window layer, key and value rings
  `ring_k` / `ring_v` [num_slots, R, kv_heads, head_dim] (model dtype, R = `ring_length(cfg)`):
  position p of the slot's sequence sits in row p % R, so a ring holds the last R positions written,
  whatever the context length. R is the window plus the tokens one sequence may add in a
  decode-kernel pass less one (that kernel writes a pass's keys before it reads the window; the
  per-sequence core reads the cached window before it writes). A slot is either a live request's
  working state or a snapshot attached to the radix tree; `copy(dst, src)` snapshots or restores
  in place (the ring with the rest: a snapshot at position p resumes the window exactly).
  `ring_rows(layer)` views one layer's rings as [num_slots * R, kv_heads, head_dim] (row slot * R +
  p % R), the layout the attention reads.
- `HostStatePool`: the host-memory spill tier for snapshots, the same per-slot layout in CPU
  tensors (pinned when the device is CUDA, so copies both ways can be asynchronous DMA);
  `store(host_slot, pool, slot)` copies a device slot down, `load(pool, slot, host_slot)` back up.
All pools never grow: their sizes are the memory budget.
"""

from __future__ import annotations

import math

import torch

from engine.config import ModelConfig
from engine.model.kernel_limits import DECODE_ATTENTION_TOKENS


def ring_length(cfg: ModelConfig) -> int:
    """Rows of a sliding-window layer's ring per sequence (0 without such layers)."""
    if not cfg.sliding_attention_layer_ids:
        return 0
    assert cfg.sliding_window is not None
    return cfg.sliding_window + DECODE_ATTENTION_TOKENS - 1


class _FreeList:
    def __init__(self, n: int) -> None:
        self.capacity = n
        self._free = list(range(n - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        out = self._free[-n:] if n else []
        del self._free[len(self._free) - n:]
        return out[::-1]

    def give(self, ids: list[int]) -> None:
        self._free.extend(ids)


class KVPool:
    def __init__(self, cfg: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        layers = len(cfg.full_attention_layer_ids)
        k_shape, v_shape = cfg.kv_slot_shapes
        self.k = torch.zeros((layers, num_slots, *k_shape), dtype=dtype, device=device)
        self.v = torch.zeros((layers, num_slots, *v_shape), dtype=dtype, device=device)
        self._slots = _FreeList(num_slots)
        self.device = device

    @property
    def capacity(self) -> int:
        return self._slots.capacity

    @property
    def num_free(self) -> int:
        return self._slots.num_free

    def alloc(self, n: int) -> torch.Tensor | None:
        ids = self.take(n)
        return None if ids is None else torch.tensor(ids, dtype=torch.long, device=self.device)

    def take(self, n: int) -> list[int] | None:
        """`n` free slots as host integers (nothing crosses to the device), or None."""
        return self._slots.take(n)

    def free(self, slots: torch.Tensor) -> None:
        self._slots.give(slots.tolist())

    @staticmethod
    def bytes_per_slot(cfg: ModelConfig, dtype: torch.dtype) -> int:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        k_shape, v_shape = cfg.kv_slot_shapes
        return len(cfg.full_attention_layer_ids) * (math.prod(k_shape) + math.prod(v_shape)) * itemsize


class _StateSlots:
    """Per Gated DeltaNet layer, conv windows and SSM states for `num_slots` slots, with a free list.
    `StatePool` keeps them on the compute device; `HostStatePool` in (pinned, for CUDA) host memory."""

    def __init__(self, cfg: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device,
                 pin_memory: bool = False) -> None:
        layers, rings = len(cfg.linear_attention_layer_ids), len(cfg.sliding_attention_layer_ids)
        n = num_slots if cfg.is_hybrid else 0
        conv_shape, ssm_shape = self.slot_shapes(cfg)
        ring_shape = self.ring_shape(cfg)
        self.ring = ring_length(cfg)
        self.conv = torch.zeros(layers, n, *conv_shape, dtype=dtype, device=device, pin_memory=pin_memory)
        self.ssm = torch.zeros(layers, n, *ssm_shape, dtype=torch.float32, device=device, pin_memory=pin_memory)
        self.ring_k = torch.zeros(rings, n, *ring_shape, dtype=dtype, device=device, pin_memory=pin_memory)
        self.ring_v = torch.zeros(rings, n, *ring_shape, dtype=dtype, device=device, pin_memory=pin_memory)
        self._slots = _FreeList(n)

    @staticmethod
    def slot_shapes(cfg: ModelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per layer and slot: the conv window's shape and the SSM state's shape."""
        return ((cfg.linear_conv_dim, max(cfg.linear_conv_kernel_dim - 1, 0)),
                (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim))

    @staticmethod
    def ring_shape(cfg: ModelConfig) -> tuple[int, int, int]:
        """Per sliding-window layer and slot: the key ring's (and the value ring's) shape."""
        return ring_length(cfg), cfg.num_kv_heads, cfg.head_dim

    @classmethod
    def bytes_per_slot(cls, cfg: ModelConfig, dtype: torch.dtype) -> int:
        """One slot across all recurrent layers and rings (the SSM state is float32 whatever the
        model dtype)."""
        conv_shape, ssm_shape = cls.slot_shapes(cfg)
        item = torch.empty(0, dtype=dtype).element_size()
        recurrent = len(cfg.linear_attention_layer_ids) * (math.prod(conv_shape) * item + math.prod(ssm_shape) * 4)
        return recurrent + cls.ring_bytes_per_slot(cfg, dtype)

    @classmethod
    def ring_bytes_per_slot(cls, cfg: ModelConfig, dtype: torch.dtype) -> int:
        """One sequence's key and value rings across the sliding-window layers: fixed by the window,
        whatever the context length."""
        item = torch.empty(0, dtype=dtype).element_size()
        return len(cfg.sliding_attention_layer_ids) * 2 * math.prod(cls.ring_shape(cfg)) * item

    def ring_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sliding-window layer `layer`'s key and value rings as rows [num_slots * R, kv_heads, dim]."""
        k, v = self.ring_k[layer], self.ring_v[layer]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])

    @property
    def capacity(self) -> int:
        return self._slots.capacity

    @property
    def num_free(self) -> int:
        return self._slots.num_free

    def alloc(self) -> int | None:
        ids = self._slots.take(1)
        return None if ids is None else ids[0]

    def free(self, slot: int) -> None:
        self._slots.give([slot])

    def _parts(self) -> tuple[torch.Tensor, ...]:
        return self.conv, self.ssm, self.ring_k, self.ring_v


class StatePool(_StateSlots):
    def reset(self, slot: int) -> None:
        for t in self._parts():
            t[:, slot].zero_()

    def copy(self, dst: int, src: int) -> None:
        for t in self._parts():
            t[:, dst].copy_(t[:, src])

    def slot_bytes(self) -> int:
        # From the shapes, so a pool of zero slots (a model without per-sequence state) reports 0 too.
        return sum(t.shape[0] * math.prod(t.shape[2:]) * t.element_size() for t in self._parts())


class HostStatePool(_StateSlots):
    def __init__(self, cfg: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(cfg, num_slots, dtype, torch.device("cpu"), pin_memory=torch.device(device).type == "cuda")

    def store(self, host_slot: int, pool: StatePool, slot: int) -> None:
        # Synchronous on purpose: the device slot is reused right after a spill.
        for mine, theirs in zip(self._parts(), pool._parts(), strict=True):
            mine[:, host_slot].copy_(theirs[:, slot])

    def load(self, pool: StatePool, slot: int, host_slot: int) -> None:
        for mine, theirs in zip(self._parts(), pool._parts(), strict=True):
            theirs[:, slot].copy_(mine[:, host_slot])
