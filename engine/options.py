"""Engine options: one frozen dataclass, validated at construction.

Contract: sizes are budgets the engine never exceeds: `kv_tokens` KV slots (tokens across all
requests and the prefix cache), `state_slots` recurrent-state slots (live requests plus
snapshots), `max_running` concurrently decoding requests, `prefill_chunk` prompt tokens per step.
`max_model_len` 0 means the model's `max_position_embeddings`.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ConfigError


@dataclass(frozen=True)
class EngineOptions:
    device: str = "cpu"
    dtype: str | None = None  # None: the checkpoint's dtype
    executor: str = "auto"  # auto | native | torch (engine.moe.executor.create_executor)
    kv_tokens: int = 65536
    state_slots: int = 32
    max_running: int = 8
    prefill_chunk: int = 1024
    max_model_len: int = 0
    threads: int = 0  # torch intra-op threads and the native executor's pool; 0 = their defaults

    def __post_init__(self) -> None:
        for name in ("kv_tokens", "max_running", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ConfigError(f"engine option {name} must be >= 1, got {getattr(self, name)}")
        if self.state_slots < self.max_running:
            raise ConfigError(f"state_slots ({self.state_slots}) must be >= max_running ({self.max_running})")
