"""Engine options: one frozen dataclass, validated at construction.

Contract: sizes are budgets the engine never exceeds: `kv_tokens` KV slots (tokens across all
requests and the prefix cache), `max_running` concurrently decoding requests, `prefill_chunk`
prompt tokens per step. Recurrent state (hybrid models only):
- `checkpoint_slots`: device checkpoint slots (snapshots attached to the radix tree);
- `host_checkpoint_slots`: host-memory spill tier for checkpoints (pinned when on CUDA);
- `state_slots`: the device state pool, shared by live requests' working states and device
  checkpoints. 0 (the default) sizes it `max_running + checkpoint_slots`, so working states never
  compete with checkpoints; an explicit value caps both together (a live request always gets a
  slot first: a checkpoint is spilled to the host tier to make room).
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
    state_slots: int = 0  # 0: max_running + checkpoint_slots
    checkpoint_slots: int = 32
    host_checkpoint_slots: int = 128
    max_running: int = 8
    prefill_chunk: int = 1024
    max_model_len: int = 0
    threads: int = 0  # torch intra-op threads and the native executor's pool; 0 = their defaults
    gpu_memory: int = 0  # bytes: the whole GPU footprint incl. an expert cache (engine/gpu); 0 = no cache
    fetch_ratio: float = -1.0  # share of misses fetched over PCIe; < 0 = from the calibration (measured if none)
    calibration_file: str = ""  # where measured bandwidths are stored per machine
    cuda_graphs: bool = True  # capture the expert cache's decode-sized MoE steps (engine/gpu/device_step.py)
    overlap_decode: bool = False  # queue the next captured decode pass before reading this one's tokens (experimental)
    # seconds between looks at the device's free memory, the expert cache following it (engine/gpu/elastic.py);
    # 0 = the cap stays as set (the CLI turns it on for --gpu-memory auto)
    follow_free_memory: float = 0.0

    def __post_init__(self) -> None:
        for name in ("kv_tokens", "max_running", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ConfigError(f"engine option {name} must be >= 1, got {getattr(self, name)}")
        if self.gpu_memory < 0 or self.fetch_ratio > 1 or self.follow_free_memory < 0:
            raise ConfigError("gpu_memory and follow_free_memory must be >= 0 and fetch_ratio <= 1")
        for name in ("state_slots", "checkpoint_slots", "host_checkpoint_slots"):
            if getattr(self, name) < 0:
                raise ConfigError(f"engine option {name} must be >= 0, got {getattr(self, name)}")
        if self.state_slots and self.state_slots < self.max_running:
            raise ConfigError(f"state_slots ({self.state_slots}) must be >= max_running ({self.max_running})")

    @property
    def device_state_slots(self) -> int:
        """Size of the device state pool (working states + device checkpoints)."""
        return self.state_slots or self.max_running + self.checkpoint_slots
