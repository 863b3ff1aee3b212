"""The built-in demo model: a small random MoE in the Hugging Face layout with a real tokenizer.

Contract: `write_demo_model(out_dir, arch)` writes `config.json`, `model.safetensors` (per-expert
tensor names, as `save_pretrained` writes them; for "gpt_oss" the experts as gpt-oss ships them,
MXFP4 `_blocks` / `_scales` with bf16-free biases) and the tokenizer files for `arch` in
{"qwen3_5_moe", "qwen3_moe", "glm4_moe_lite", "gpt_oss"} (gpt_oss: o200k_harmony and the harmony
template); weights come from a fixed seed, so every machine gets the same model. Sized to decode at
20+ tokens/s on two CPU cores; it holds 131072 positions, so it can be
served with the context window Claude Code needs (`serve --kv-tokens 131072`). `demo_model_dir(arch)` returns the copy
in the user's cache directory, creating it on first use (atomically, so a crash never leaves half
a model behind) with a progress display on a terminal. Both take an optional `progress(done, total,
label)` callback, called once per step. Importing this module imports neither torch nor safetensors.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from freetoken_agent.tokenizer.build import Family

ARCHES = ("qwen3_5_moe", "qwen3_moe", "glm4_moe_lite", "gpt_oss")
# The chat format each demo speaks. No package ships GLM's tokenizer: the GLM-4.7-Flash-shaped demo
# (multi-head latent attention, sigmoid grouped router, a dense first layer) carries Qwen3's.
TOKENIZERS: dict[str, Family] = {"qwen3_5_moe": "qwen3_5", "qwen3_moe": "qwen3", "glm4_moe_lite": "qwen3",
                                 "gpt_oss": "gpt_oss"}
DEMO_VERSION = 4  # 4: the Qwen3.5 template renders as the checkpoints' (trimmed text, True / False values)
SEED = 1234


def _config(arch: str, vocab_size: int, eos: int, pad: int) -> dict[str, Any]:
    common: dict[str, Any] = {
        "vocab_size": vocab_size, "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "hidden_act": "silu", "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False, "num_experts": 16,
        "num_experts_per_tok": 4, "moe_intermediate_size": 128, "eos_token_id": eos, "pad_token_id": pad,
        "bos_token_id": None, "dtype": "float32",
    }
    if arch == "glm4_moe_lite":
        mla = {k: v for k, v in common.items() if k not in ("num_experts", "head_dim")}
        return {**mla, "architectures": ["Glm4MoeLiteForCausalLM"], "model_type": "glm4_moe_lite",
                "num_key_value_heads": 4, "n_routed_experts": 16, "n_shared_experts": 1, "n_group": 1,
                "topk_group": 1, "routed_scaling_factor": 1.8, "norm_topk_prob": True, "intermediate_size": 256,
                "q_lora_rank": 96, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 32,
                "v_head_dim": 32, "rope_interleave": True, "mlp_layer_types": ["dense"] + ["sparse"] * 3,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}
    if arch == "gpt_oss":
        rest = {k: v for k, v in common.items() if k not in ("num_experts", "moe_intermediate_size")}
        return {**rest, "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
                "num_local_experts": common["num_experts"], "intermediate_size": common["moe_intermediate_size"],
                "sliding_window": 128, "rms_norm_eps": 1e-5, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
                "layer_types": ["sliding_attention", "full_attention"] * 2,
                "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "truncate": False, "original_max_position_embeddings": 4096,
                                    "rope_theta": 150000.0}}
    if arch == "qwen3_moe":
        return {**common, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                "intermediate_size": 256, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}
    return {**common, "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
            "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "shared_expert_intermediate_size": 128,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}}


# Rows of lm_head that make the random model end its reasoning and its turn by itself: the row of
# `</think>` is STOP_GAIN * e_0, that of `<|im_end|>` STOP_GAIN * e_1, so each wins where one
# coordinate of the normalised final hidden state is large (a few percent of positions). Without it
# every reply runs into max_tokens, which Claude Code and Codex report as an error.
STOP_GAIN = 16.0


def _gpt_oss_layer(out: dict[str, torch.Tensor], p: str, cfg: dict[str, Any], gen: torch.Generator) -> None:
    """Attention with biases and sinks, a biased router, MXFP4 experts (values of about 0.05)."""
    import torch

    h, hd, nh, nkv = cfg["hidden_size"], cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    e, inter = cfg["num_local_experts"], cfg["intermediate_size"]
    shapes = {"self_attn.q_proj": (nh * hd, h), "self_attn.k_proj": (nkv * hd, h), "self_attn.v_proj": (nkv * hd, h),
              "self_attn.o_proj": (h, nh * hd), "mlp.router": (e, h)}
    for name, shape in shapes.items():
        out[f"{p}{name}.weight"] = torch.randn(*shape, generator=gen) * (0.5 if "router" in name else 0.05)
        out[f"{p}{name}.bias"] = torch.randn(shape[0], generator=gen) * 0.01
    out[p + "self_attn.sinks"] = torch.zeros(nh)
    for name, rows, cols in (("gate_up_proj", 2 * inter, h), ("down_proj", h, inter)):
        out[f"{p}mlp.experts.{name}_blocks"] = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=gen,
                                                             dtype=torch.uint8)
        out[f"{p}mlp.experts.{name}_scales"] = torch.full((e, rows, cols // 32), 122, dtype=torch.uint8)  # 2^-5
        out[f"{p}mlp.experts.{name}_bias"] = torch.zeros(e, rows)


def _weights(cfg: dict[str, Any], stop_ids: tuple[int, int]) -> dict[str, torch.Tensor]:
    import torch

    gen = torch.Generator().manual_seed(SEED)
    h, std = cfg["hidden_size"], 0.05
    out: dict[str, torch.Tensor] = {}

    def rand(name: str, *shape: int, scale: float = std) -> None:
        out[name] = torch.randn(*shape, generator=gen) * scale

    qwen35 = cfg["model_type"] == "qwen3_5_moe_text"
    norm = (lambda n: torch.zeros(n)) if qwen35 else (lambda n: torch.ones(n))
    rand("model.embed_tokens.weight", cfg["vocab_size"], h, scale=0.5)
    # An untied random head: with tied embeddings a random model echoes its last input token forever.
    rand("lm_head.weight", cfg["vocab_size"], h, scale=0.5)
    for dim, token_id in enumerate(stop_ids):
        out["lm_head.weight"][token_id] = 0.0
        out["lm_head.weight"][token_id, dim] = STOP_GAIN
    out["model.norm.weight"] = norm(h)
    mla = cfg["model_type"] == "glm4_moe_lite"
    for li in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{li}."
        out[p + "input_layernorm.weight"] = norm(h)
        out[p + "post_attention_layernorm.weight"] = norm(h)
        if cfg["model_type"] == "gpt_oss":
            _gpt_oss_layer(out, p, cfg, gen)
            continue
        if mla:
            _mla_attention(cfg, p + "self_attn.", rand, out)
        elif qwen35 and cfg["layer_types"][li] == "linear_attention":
            kd = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
            vd = cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
            hv = cfg["linear_num_value_heads"]
            rand(p + "linear_attn.in_proj_qkv.weight", 2 * kd + vd, h)
            rand(p + "linear_attn.in_proj_z.weight", vd, h)
            rand(p + "linear_attn.in_proj_a.weight", hv, h)
            rand(p + "linear_attn.in_proj_b.weight", hv, h)
            rand(p + "linear_attn.conv1d.weight", 2 * kd + vd, 1, cfg["linear_conv_kernel_dim"], scale=0.5)
            out[p + "linear_attn.A_log"] = torch.empty(hv).uniform_(0.0, 2.0, generator=gen).log()
            out[p + "linear_attn.dt_bias"] = torch.ones(hv)
            out[p + "linear_attn.norm.weight"] = torch.ones(cfg["linear_value_head_dim"])
            rand(p + "linear_attn.out_proj.weight", h, vd)
        else:
            hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
            rand(p + "self_attn.q_proj.weight", nh * hd * (2 if qwen35 else 1), h)
            rand(p + "self_attn.k_proj.weight", nkv * hd, h)
            rand(p + "self_attn.v_proj.weight", nkv * hd, h)
            rand(p + "self_attn.o_proj.weight", h, nh * hd)
            out[p + "self_attn.q_norm.weight"] = norm(hd)
            out[p + "self_attn.k_norm.weight"] = norm(hd)
        if mla and cfg["mlp_layer_types"][li] == "dense":
            rand(p + "mlp.gate_proj.weight", cfg["intermediate_size"], h)
            rand(p + "mlp.up_proj.weight", cfg["intermediate_size"], h)
            rand(p + "mlp.down_proj.weight", h, cfg["intermediate_size"])
            continue
        inter = cfg["moe_intermediate_size"]
        experts = cfg["n_routed_experts"] if mla else cfg["num_experts"]
        rand(p + "mlp.gate.weight", experts, h, scale=0.5)
        for e in range(experts):
            rand(f"{p}mlp.experts.{e}.gate_proj.weight", inter, h)
            rand(f"{p}mlp.experts.{e}.up_proj.weight", inter, h)
            rand(f"{p}mlp.experts.{e}.down_proj.weight", h, inter)
        if mla:
            rand(p + "mlp.gate.e_score_correction_bias", experts, scale=0.1)
            for name, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
                rand(f"{p}mlp.shared_experts.{name}.weight", *shape)
        if qwen35:
            si = cfg["shared_expert_intermediate_size"]
            rand(p + "mlp.shared_expert.gate_proj.weight", si, h)
            rand(p + "mlp.shared_expert.up_proj.weight", si, h)
            rand(p + "mlp.shared_expert.down_proj.weight", h, si)
            rand(p + "mlp.shared_expert_gate.weight", 1, h)
    return {k: v.contiguous() for k, v in out.items()}


def _mla_attention(cfg: dict[str, Any], ap: str, rand: Callable[..., None], out: dict[str, torch.Tensor]) -> None:
    """GLM-4.7-Flash's attention tensors: q through its low-rank pair, the latent KV projection."""
    import torch

    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    qk, c = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], cfg["kv_lora_rank"]
    rand(ap + "q_a_proj.weight", cfg["q_lora_rank"], h)
    out[ap + "q_a_layernorm.weight"] = torch.ones(cfg["q_lora_rank"])
    rand(ap + "q_b_proj.weight", nh * qk, cfg["q_lora_rank"])
    rand(ap + "kv_a_proj_with_mqa.weight", c + cfg["qk_rope_head_dim"], h)
    out[ap + "kv_a_layernorm.weight"] = torch.ones(c)
    rand(ap + "kv_b_proj.weight", nh * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), c)
    rand(ap + "o_proj.weight", h, nh * cfg["v_head_dim"])


Progress = Callable[..., None]  # (done, total, label)
STEPS = ("tokenizer from the real vocabulary", "random weights", "model.safetensors")


def _no_progress(done: int, total: int, label: str | None = None) -> None:
    return None


def write_demo_model(out_dir: Path | str, arch: str = "qwen3_5_moe", progress: Progress = _no_progress) -> Path:
    if arch not in ARCHES:
        raise ValueError(f"unknown demo arch {arch!r} (choose from {', '.join(ARCHES)})")
    from safetensors.torch import save_file

    from freetoken_agent.tokenizer import write_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    progress(0, len(STEPS), STEPS[0])
    info = write_tokenizer(out, TOKENIZERS[arch])
    cfg = _config(arch, info.vocab_size, info.eos_token_id, info.pad_token_id)
    # the rows that end reasoning and the turn: harmony's <|end|> closes the analysis message
    stop_ids = (info.special_ids["<|end|>" if arch == "gpt_oss" else "</think>"], info.eos_token_id)
    progress(1, len(STEPS), STEPS[1])
    weights = _weights(cfg, stop_ids)
    progress(2, len(STEPS), STEPS[2])
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    progress(3, len(STEPS), None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    eos = [info.eos_token_id, info.pad_token_id]
    if arch == "gpt_oss":  # a turn also stops at a tool call
        eos.append(info.special_ids["<|call|>"])
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "do_sample": False}, indent=2) + "\n")
    return out


def cache_root() -> Path:
    base = os.environ.get("FREETOKEN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "freetoken-agent")
    return Path(base)


def demo_model_dir(arch: str = "qwen3_5_moe", progress: Progress | None = None) -> Path:
    target = cache_root() / f"demo-{arch}-v{DEMO_VERSION}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        if progress is None:
            from freetoken_agent.progress import load_progress

            with load_progress(f"writing the demo model to {target} (once)") as bar:
                write_demo_model(tmp, arch, bar)
        else:
            write_demo_model(tmp, arch, progress)
        try:
            tmp.rename(target)
        except OSError:  # another process made it first
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
