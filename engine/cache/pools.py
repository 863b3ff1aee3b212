"""Pre-allocated KV and recurrent-state pools.

Contract:
- `KVPool`: per full-attention layer, key and value tensors [num_slots, heads, dim] of the shapes
  `cfg.kv_slot_shapes` gives (GQA: kv_heads x head_dim each; MLA: one latent row of kv_lora_rank +
  qk_rope_head_dim as the key, an empty value); one slot holds one token (page size 1, so the radix tree can share any prefix). `alloc(n)` returns n
  free slot ids or None when the pool is short; `free(slots)` returns them.
- `StatePool`: per Gated DeltaNet layer, conv windows [num_slots, C, K-1] (model dtype) and SSM
  states [num_slots, Hv, dk, dv] (float32). A slot is either a live request's working state or a
  snapshot attached to the radix tree; `copy(dst, src)` snapshots or restores in place.
- `HostStatePool`: the host-memory spill tier for snapshots, the same per-slot layout in CPU
  tensors (pinned when the device is CUDA, so copies both ways can be asynchronous DMA);
  `store(host_slot, pool, slot)` copies a device slot down, `load(pool, slot, host_slot)` back up.
All pools never grow: their sizes are the memory budget.
"""

from __future__ import annotations

import math

import torch

from engine.config import ModelConfig


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
        layers = len(cfg.linear_attention_layer_ids)
        n = num_slots if layers else 0
        conv_shape, ssm_shape = self.slot_shapes(cfg)
        self.conv = torch.zeros(layers, n, *conv_shape, dtype=dtype, device=device, pin_memory=pin_memory)
        self.ssm = torch.zeros(layers, n, *ssm_shape, dtype=torch.float32, device=device, pin_memory=pin_memory)
        self._slots = _FreeList(n)

    @staticmethod
    def slot_shapes(cfg: ModelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per layer and slot: the conv window's shape and the SSM state's shape."""
        return ((cfg.linear_conv_dim, max(cfg.linear_conv_kernel_dim - 1, 0)),
                (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim))

    @classmethod
    def bytes_per_slot(cls, cfg: ModelConfig, dtype: torch.dtype) -> int:
        """One slot across all recurrent layers (the SSM state is float32 whatever the model dtype)."""
        conv_shape, ssm_shape = cls.slot_shapes(cfg)
        item = torch.empty(0, dtype=dtype).element_size()
        return len(cfg.linear_attention_layer_ids) * (math.prod(conv_shape) * item + math.prod(ssm_shape) * 4)

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


class StatePool(_StateSlots):
    def reset(self, slot: int) -> None:
        self.conv[:, slot].zero_()
        self.ssm[:, slot].zero_()

    def copy(self, dst: int, src: int) -> None:
        self.conv[:, dst].copy_(self.conv[:, src])
        self.ssm[:, dst].copy_(self.ssm[:, src])

    def slot_bytes(self) -> int:
        # From the shapes, so a pool of zero slots (a model without recurrent layers) reports 0 too.
        conv = self.conv.shape[0] * math.prod(self.conv.shape[2:]) * self.conv.element_size()
        ssm = self.ssm.shape[0] * math.prod(self.ssm.shape[2:]) * 4
        return conv + ssm


class HostStatePool(_StateSlots):
    def __init__(self, cfg: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(cfg, num_slots, dtype, torch.device("cpu"), pin_memory=torch.device(device).type == "cuda")

    def store(self, host_slot: int, pool: StatePool, slot: int) -> None:
        # Synchronous on purpose: the device slot is reused right after a spill.
        self.conv[:, host_slot].copy_(pool.conv[:, slot])
        self.ssm[:, host_slot].copy_(pool.ssm[:, slot])

    def load(self, pool: StatePool, slot: int, host_slot: int) -> None:
        pool.conv[:, slot].copy_(self.conv[:, host_slot])
        pool.ssm[:, slot].copy_(self.ssm[:, host_slot])
