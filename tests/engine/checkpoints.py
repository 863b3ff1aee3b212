"""Tiny random checkpoints built with `transformers`, and the reference computations run on them.

`build(spec, dest)` instantiates the Hugging Face model a `TinySpec` describes, re-initialises its
parameters from a fixed seed with a large spread (so logits are far from uniform and greedy
decoding has no near-ties), saves it with `save_pretrained` in float32 and then rewrites the files
into the requested on-disk layout:

- "per_expert": what `save_pretrained` writes, `mlp.experts.{e}.{gate,up,down}_proj.weight`;
- "fused": `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows, then up rows) and
  `mlp.experts.down_proj` [E, H, I], as the in-memory HF modules hold them;
- "fused_t": the same two tensors transposed per expert ([E, H, 2I], [E, I, H]);

optionally split round-robin into `shards` files with a `model.safetensors.index.json`.

`save_pretrained` (transformers 5) writes the Qwen3-MoE expert count as `num_local_experts`
(`Qwen3MoeConfig.attribute_map`); released Qwen3-MoE checkpoints spell it `num_experts`, so
`build` rewrites it that way unless `raw_config=True`.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

LIN, FULL = "linear_attention", "full_attention"

_PER_EXPERT = re.compile(r"^(?P<base>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")

# Tiny vision tower for the vision-language wrapper (its tensors must be ignored by the engine).
TINY_VISION = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, patch_size=4,
                   num_position_embeddings=16, spatial_merge_size=2, temporal_patch_size=2)


@dataclass(frozen=True)
class TinySpec:
    name: str
    family: str  # "qwen3_moe" or "qwen3_5_moe"
    text: dict[str, Any]  # text-config keyword arguments
    layout: str = "per_expert"  # "per_expert", "fused" or "fused_t"
    shards: int = 1
    vl: bool = False  # wrap in Qwen3_5MoeForConditionalGeneration
    seed: int = 0
    std: float = 0.3
    raw_config: bool = False  # keep config.json exactly as save_pretrained wrote it
    engine: dict[str, Any] = field(default_factory=dict)  # EngineOptions overrides for this case

    def __repr__(self) -> str:
        return self.name


def qwen3_moe_text(**kw: Any) -> dict[str, Any]:
    base = dict(vocab_size=128, hidden_size=32, intermediate_size=40, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=24,
                num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512,
                eos_token_id=None, pad_token_id=None, bos_token_id=None)
    base.update(kw)
    return base


def qwen3_5_moe_text(**kw: Any) -> dict[str, Any]:
    base = dict(vocab_size=128, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=4,
                moe_intermediate_size=24, shared_expert_intermediate_size=24, num_experts=6,
                num_experts_per_tok=2, max_position_embeddings=512, layer_types=[LIN, LIN, LIN, FULL],
                eos_token_id=None, pad_token_id=None, bos_token_id=None)
    base.update(kw)
    return base


# ---------------------------------------------------------------------------------------- building
def make_hf_model(spec: TinySpec) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(spec.seed)
    if spec.family == "qwen3_moe":
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**spec.text))
    elif spec.vl:
        cfg = tf.Qwen3_5MoeConfig(text_config=dict(spec.text), vision_config=dict(TINY_VISION,
                                  out_hidden_size=spec.text["hidden_size"]),
                                  tie_word_embeddings=spec.text.get("tie_word_embeddings", False))
        model = tf.Qwen3_5MoeForConditionalGeneration(cfg)
    else:
        model = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**spec.text))
    model = model.float().eval()
    reinit_(model, spec.seed, spec.std)
    return model


@torch.no_grad()
def reinit_(model: torch.nn.Module, seed: int, std: float) -> None:
    """Re-draws every text-tower parameter from `seed`: matrices ~ N(0, std), norm weights around
    their neutral value (0 for the zero-centred (1 + w) norms, 1 otherwise), and Gated DeltaNet
    decay parameters in a range where the recurrent state keeps a memory of several tokens."""
    g = torch.Generator().manual_seed(seed)

    def normal(p: torch.Tensor, s: float) -> torch.Tensor:
        return torch.randn(p.shape, generator=g, dtype=torch.float32) * s

    for name, p in sorted(model.named_parameters()):
        if ".visual." in name or name.startswith("visual."):
            continue
        if name.endswith("A_log"):
            p.copy_((torch.rand(p.shape, generator=g) * 0.28 + 0.02).log())  # exp(A) in [0.02, 0.3]
        elif name.endswith("dt_bias"):
            p.copy_(normal(p, 0.5))
        elif p.ndim == 1:
            neutral = 0.0 if bool((p == 0).all()) else 1.0
            p.copy_(neutral + normal(p, 0.2))
        else:
            p.copy_(normal(p, std))


def build(spec: TinySpec, dest: Path) -> tuple[Path, torch.nn.Module]:
    """Builds and saves the checkpoint of `spec` under `dest`; returns (directory, HF model)."""
    model = make_hf_model(spec)
    dest = Path(dest)
    model.save_pretrained(dest)
    if not spec.raw_config:
        normalize_config(dest)
    if spec.layout != "per_expert":
        rewrite_experts(dest, spec.layout)
    if spec.shards > 1:
        shard(dest, spec.shards)
    return dest, model


def normalize_config(path: Path) -> None:
    cfg_path = Path(path) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if "num_local_experts" in cfg and "num_experts" not in cfg:
        cfg["num_experts"] = cfg.pop("num_local_experts")
    cfg_path.write_text(json.dumps(cfg, indent=2))


def edit_config(path: Path, fn: Any) -> None:
    """Applies `fn(dict)` to config.json in place."""
    cfg_path = Path(path) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    fn(cfg)
    cfg_path.write_text(json.dumps(cfg, indent=2))


def copy_checkpoint(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return Path(dest)


# ---------------------------------------------------------------------------------------- layouts
def weight_files(path: Path) -> list[Path]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        return sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    return sorted(path.glob("*.safetensors"))


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in weight_files(path):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():  # noqa: SIM118 (safe_open handles are not mappings)
                out[k] = h.get_tensor(k)
    return out


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Replaces the checkpoint's weights with `tensors` in a single model.safetensors."""
    path = Path(path)
    for f in weight_files(path):
        f.unlink()
    (path / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})


def fuse_experts(tensors: dict[str, torch.Tensor], transposed: bool = False) -> dict[str, torch.Tensor]:
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        m = _PER_EXPERT.match(name)
        if m is None:
            out[name] = t
            continue
        groups.setdefault(m["base"], {}).setdefault(int(m["e"]), {})[m["proj"]] = t
    for base, experts in groups.items():
        ids = sorted(experts)
        assert ids == list(range(len(ids))), f"non-contiguous experts under {base}"
        gate_up = torch.stack([torch.cat([experts[e]["gate"], experts[e]["up"]], dim=0) for e in ids])
        down = torch.stack([experts[e]["down"] for e in ids])
        if transposed:
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        out[f"{base}.gate_up_proj"] = gate_up.contiguous()
        out[f"{base}.down_proj"] = down.contiguous()
    assert groups, "checkpoint has no per-expert tensors to fuse"
    return out


def rewrite_experts(path: Path, layout: str) -> None:
    if layout not in ("fused", "fused_t"):
        raise ValueError(f"unknown expert layout {layout!r}")
    write_tensors(path, fuse_experts(load_tensors(path), transposed=layout == "fused_t"))


def shard(path: Path, n: int) -> list[Path]:
    """Splits the checkpoint round-robin (over sorted names) into n files plus an index, so the
    tensors of one layer (and of one expert bank) are spread over several files."""
    path = Path(path)
    tensors = load_tensors(path)
    names = sorted(tensors)
    files = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    parts: list[dict[str, torch.Tensor]] = [{} for _ in range(n)]
    weight_map = {}
    for i, name in enumerate(names):
        parts[i % n][name] = tensors[name]
        weight_map[name] = files[i % n]
    for f in weight_files(path):
        f.unlink()
    for fname, part in zip(files, parts, strict=True):
        save_file({k: v.contiguous() for k, v in part.items()}, str(path / fname), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return [path / f for f in files]


# ---------------------------------------------------------------------------------------- references
@torch.no_grad()
def hf_prefill_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """Reference logits [T, V] at every position of one full forward pass."""
    return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()


@torch.no_grad()
def hf_step_logits(model: torch.nn.Module, prompt: list[int], fed: list[int]) -> torch.Tensor:
    """Reference logits [1 + len(fed), V]: the last prefill row, then one row after feeding each
    token of `fed` one at a time through the model's own KV / recurrent cache."""
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    rows = [out.logits[0, -1].float()]
    cache = out.past_key_values
    for tok in fed:
        out = model(input_ids=torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        rows.append(out.logits[0, -1].float())
    return torch.stack(rows)


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                         min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref|."""
    assert a.shape == ref.shape, f"shape {tuple(a.shape)} != reference {tuple(ref.shape)}"
    return float((a.float() - ref.float()).abs().max() / ref.float().abs().max())


# ---------------------------------------------------------------------------------------- engine
def assert_no_leaks(engine: Any) -> None:
    """With no request in flight, every KV slot is free or held by the prefix cache, and every
    recurrent-state slot is free or a cache snapshot."""
    with engine._step_lock:  # no step runs while this is held
        s = engine.scheduler
        assert not s.running and not s.waiting, "engine still has work"
        assert s.kv.num_free + s.cache.cached_tokens == s.kv.capacity, (
            f"KV slots leaked: {s.kv.num_free} free + {s.cache.cached_tokens} cached != {s.kv.capacity}")
        if s.hybrid:
            assert s.states.num_free + s.cache.num_snapshots == s.states.capacity, (
                f"state slots leaked: {s.states.num_free} free + {s.cache.num_snapshots} snapshots "
                f"!= {s.states.capacity}")
