"""Read a GGUF file (llama.cpp's format) as if it were a Hugging Face checkpoint.

Contract: `GgufReader(path)` opens a `.gguf` file with the `gguf` package (memory-mapped, nothing
read up front) and answers like `CheckpointReader` (engine/weights/reader.py): `names()`, `has`,
`shape`, `nbytes`, `file_of`, `get(name)` under the checkpoint names `load_weights` asks for, so
the same loader fills the same layout; `config()` is the model's config as a Hugging Face
config dict, built from the GGUF metadata. A split set (`NAME-00001-of-0000N.gguf`, named by its
first part) reads as one file. Tensors in F32, F16, BF16 or any quant type of engine/quant/formats.py:
`get` dequantizes a quantized tensor to float32 (the loader casts it to the dense dtype);
`packed(name)` gives a quantized tensor's raw rows (uint8 [..., row_bytes]) and its format, which the
loader copies into packed expert banks as they are. Supported architectures:
- `qwen3moe` (Qwen3-MoE): the tensors map one to one (llama.cpp stores Qwen3's projections
  unpermuted, NEOX rotary, softmax routing with normalised top-k weights, as Hugging Face does);
- `qwen35moe` (Qwen3.5 / Qwen3.6-MoE, Gated DeltaNet hybrid), where llama.cpp's conventions differ
  from the checkpoint's in three places, undone here: its RMSNorm weights are the multipliers
  (Hugging Face stores them zero-centred: 1 + w), `ssm_a` is -exp(A_log), and a Gated DeltaNet
  value head h reads key head h mod (key heads) (tiled) where Hugging Face's reads h div (value
  heads per key head) (grouped), so every value-head-indexed tensor is permuted into grouped order.
  evals/peer/check_logits.py runs both programs on one file and compares their logits;
- `qwen3next` (Qwen3-Next): as qwen35moe (norms as multipliers, `ssm_a` = -exp(A_log)), but its
  value heads are in grouped order already (llama.cpp's qwen3next graph repeats each key head over
  its value heads, as Hugging Face does) and beta / alpha come as one `ssm_ba` laid out as Hugging
  Face's `in_proj_ba`, read as `in_proj_b` / `in_proj_a`; llama.cpp normalises the top-k weights;
- `glm4moe` (GLM-4.5 / 4.6 / 4.7): the tensors map one to one (NEOX partial rotary as Hugging
  Face stores it); `block_count` counts the next-token-prediction layers, which are left out;
  sigmoid routing (`expert_gating_func` 2) with `exp_probs_b` as the correction bias;
- `deepseek2` (DeepSeek-V3, Kimi-K2, GLM-4.7-Flash: MLA): the same routing; the MLA sizes from
  `key_length_mla` / `value_length_mla` (older files: `key_length` / `value_length`), YaRN from
  `rope.scaling.*` (mscale = mscale_all_dim = yarn_log_multiplier / 0.1), rope dims interleaved as
  in the checkpoint; `kv_b_proj` is `attn_kv_b`, or rebuilt from the split `attn_k_b` (per head
  [kv_lora, nope], transposed) and `attn_v_b` ([v, kv_lora]) newer converters write.
- `gpt-oss`: one to one, with the attention biases and sinks (`attn_sinks`), the router with its
  bias (`ffn_gate_inp`), and the experts as separate `ffn_{gate,up,down}_exps` with `.bias` each
  (llama.cpp's converter splits Hugging Face's interleaved gate_up; engine/weights/gpt_oss.py
  reads them); even layers slide (llama.cpp's pattern), YaRN from `rope.scaling.*`.
  These conventions are read from the gguf package's name map and llama.cpp's converter as
  documented; no file written by llama.cpp itself was available to check them against.
Anything else (another architecture, a quant type without a format here) raises `ConfigError` /
`WeightError` naming the file, the tensor and its type. Needs the `gguf` package (`pip install gguf`).

Why: the peer benchmark (evals/peer/) runs llama.cpp on a GGUF; reading the same file gives both
systems the same weights, byte for byte.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.errors import ConfigError, WeightError
from engine.quant.formats import FORMATS, GGML_FORMATS

_ARCHS = {"qwen3moe": "qwen3_moe", "qwen35moe": "qwen3_5_moe_text", "qwen3next": "qwen3_next", "glm4moe": "glm4_moe",
          "deepseek2": "deepseek_v3", "gpt-oss": "gpt_oss"}
# GGUF tensor name (with {i} for the block) -> checkpoint name; the Qwen3.5 names below add to these
_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.ffn_gate_inp.weight": "model.layers.{i}.mlp.gate.weight",
    "blk.{i}.ffn_gate_exps.weight": "model.layers.{i}.mlp.experts.gate_proj",
    "blk.{i}.ffn_up_exps.weight": "model.layers.{i}.mlp.experts.up_proj",
    "blk.{i}.ffn_down_exps.weight": "model.layers.{i}.mlp.experts.down_proj",
    # newer converters write gate and up as one tensor [E, 2I, H], gate rows first
    "blk.{i}.ffn_gate_up_exps.weight": "model.layers.{i}.mlp.experts.gate_up_proj",
}
_LIN = "model.layers.{i}.linear_attn."
_NAMES_35 = {
    **_NAMES,
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_qkv.weight": _LIN + "in_proj_qkv.weight",
    "blk.{i}.attn_gate.weight": _LIN + "in_proj_z.weight",
    "blk.{i}.ssm_conv1d.weight": _LIN + "conv1d.weight",
    "blk.{i}.ssm_dt.bias": _LIN + "dt_bias",
    "blk.{i}.ssm_a": _LIN + "A_log",
    "blk.{i}.ssm_beta.weight": _LIN + "in_proj_b.weight",
    "blk.{i}.ssm_alpha.weight": _LIN + "in_proj_a.weight",
    "blk.{i}.ssm_norm.weight": _LIN + "norm.weight",
    "blk.{i}.ssm_out.weight": _LIN + "out_proj.weight",
    "blk.{i}.ffn_gate_inp_shexp.weight": "model.layers.{i}.mlp.shared_expert_gate.weight",
    "blk.{i}.ffn_gate_shexp.weight": "model.layers.{i}.mlp.shared_expert.gate_proj.weight",
    "blk.{i}.ffn_up_shexp.weight": "model.layers.{i}.mlp.shared_expert.up_proj.weight",
    "blk.{i}.ffn_down_shexp.weight": "model.layers.{i}.mlp.shared_expert.down_proj.weight",
}
# Qwen3-Next: Qwen3.5's names, but beta and alpha in one ssm_ba (in_proj_a / in_proj_b are read out of it)
_NAMES_NEXT = {**{k: v for k, v in _NAMES_35.items() if not k.startswith(("blk.{i}.ssm_beta", "blk.{i}.ssm_alpha"))},
               "blk.{i}.ssm_ba.weight": _LIN + "in_proj_ba.weight"}
_ATT = "model.layers.{i}.self_attn."
_MLP = "model.layers.{i}.mlp."
_NAMES_GLM = {
    **{k: v for k, v in _NAMES.items() if not k.startswith("blk.{i}.ffn_norm")},
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    **{f"blk.{{i}}.attn_{x}.bias": f"{_ATT}{x}_proj.bias" for x in "qkv"},
    "blk.{i}.exp_probs_b.bias": _MLP + "gate.e_score_correction_bias",
    **{f"blk.{{i}}.ffn_{x}_shexp.weight": f"{_MLP}shared_experts.{x}_proj.weight" for x in ("gate", "up", "down")},
    **{f"blk.{{i}}.ffn_{x}.weight": f"{_MLP}{x}_proj.weight" for x in ("gate", "up", "down")},  # dense layers
}
_MLA_NAMES = {"attn_q_a": "q_a_proj", "attn_q_a_norm": "q_a_layernorm", "attn_q_b": "q_b_proj", "attn_q": "q_proj",
              "attn_kv_a_mqa": "kv_a_proj_with_mqa", "attn_kv_a_norm": "kv_a_layernorm", "attn_kv_b": "kv_b_proj",
              "attn_k_b": "k_b_proj", "attn_v_b": "v_b_proj", "attn_output": "o_proj"}
_NAMES_DS2 = {
    **{k: v for k, v in _NAMES_GLM.items() if not k.startswith(("blk.{i}.attn_", "blk.{i}.post_attention_norm"))},
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    **{f"blk.{{i}}.{g}.weight": f"{_ATT}{h}.weight" for g, h in _MLA_NAMES.items()},
    "blk.{i}.attn_kv_a_mqa.bias": _ATT + "kv_a_proj_with_mqa.bias",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
}
_EXP = "model.layers.{i}.mlp.experts."
_NAMES_GPT_OSS = {
    **{k: v for k, v in _NAMES.items() if not k.startswith(("blk.{i}.ffn_norm", "blk.{i}.ffn_gate_inp",
                                                             "blk.{i}.attn_q_norm", "blk.{i}.attn_k_norm"))},
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    **{f"blk.{{i}}.attn_{x}.bias": f"{_ATT}{x}_proj.bias" for x in "qkv"},
    "blk.{i}.attn_output.bias": _ATT + "o_proj.bias",
    "blk.{i}.attn_sinks.weight": _ATT + "sinks",
    "blk.{i}.ffn_gate_inp.weight": _MLP + "router.weight",
    "blk.{i}.ffn_gate_inp.bias": _MLP + "router.bias",
    # experts as separate gate / up / down matrices (engine/weights/gpt_oss.py), biases beside them
    **{f"blk.{{i}}.ffn_{x}_exps.bias": f"{_EXP}{x}_proj_bias" for x in ("gate", "up", "down")},
}
_TABLES = {"qwen3moe": _NAMES, "qwen35moe": _NAMES_35, "qwen3next": _NAMES_NEXT, "glm4moe": _NAMES_GLM,
           "deepseek2": _NAMES_DS2, "gpt-oss": _NAMES_GPT_OSS}
# Qwen3.5's zero-centred RMSNorms (the Gated DeltaNet output norm is a plain one)
_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight",
            "model.norm.weight")


def _patterns(table: dict[str, str]) -> list[tuple[re.Pattern[str], str]]:
    return [(re.compile("^" + re.escape(g).replace(r"\{i\}", r"(\d+)") + "$"), h) for g, h in table.items()]
_FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _import_gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise ConfigError("reading a .gguf model needs the gguf package: pip install 'freetoken-agent[gguf]' (or gguf)") from None
    return gguf


def _checkpoint_name(gguf_name: str, patterns: list[tuple[re.Pattern[str], str]]) -> str | None:
    for pattern, target in patterns:
        m = pattern.match(gguf_name)
        if m:
            return target.format(i=m.group(1)) if m.groups() else target
    return None


_SPLIT = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")


def split_parts(path: Path) -> list[Path]:
    """The files of a split set named by its first part (`-00001-of-0000N.gguf`), else [path]."""
    m = _SPLIT.match(path.name)
    if m is None:
        return [path]
    if int(m.group(2)) != 1:
        raise ConfigError(f"{path}: part {int(m.group(2))} of a split GGUF; name the first part "
                          f"({m.group(1)}-00001-of-{m.group(3)}.gguf)")
    count = int(m.group(3))
    return [path.with_name(f"{m.group(1)}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def _checked_reader(gguf: Any) -> Any:
    """gguf's reader, checking each tensor's type and extent before it maps it, so a truncated file or
    an unknown type is named by its tensor (the package's own errors name neither)."""

    class CheckedReader(gguf.GGUFReader):  # type: ignore[misc,name-defined]
        def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
            for field in fields:
                _, name_data, _, dims, raw_dtype, offset = field.parts
                name = bytes(name_data).decode("utf-8", errors="replace")
                try:
                    qtype = gguf.GGMLQuantizationType(int(raw_dtype[0]))
                except ValueError:
                    raise ValueError(f"tensor {name!r} has unknown type {int(raw_dtype[0])}") from None
                block, size = gguf.GGML_QUANT_SIZES[qtype]
                n = int(np.prod(dims))
                if n % block:
                    raise ValueError(f"tensor {name!r} ({qtype.name}): {n} values are not whole {block}-value blocks")
                end = start_offs + int(offset[0]) + n // block * size
                if end > len(self.data):
                    raise ValueError(f"tensor {name!r} ({qtype.name}) ends at byte {end}, past the end of the file "
                                     f"({len(self.data)} bytes): truncated")
            super()._build_tensors(start_offs, fields)

    return CheckedReader


def _open(gguf: Any, path: Path) -> Any:
    try:
        return _checked_reader(gguf)(str(path), "r")
    except FileNotFoundError:
        raise WeightError(f"{path}: file not found") from None
    except Exception as e:  # gguf raises ValueError and friends for a bad file (truncated, unknown type)
        raise WeightError(f"{path}: not a readable GGUF file ({e})") from None


class GgufReader:
    def __init__(self, path: Path | str) -> None:
        gguf = _import_gguf()
        self.path = Path(path)
        self.model_dir = self.path  # what error messages name
        readers = [_open(gguf, p) for p in split_parts(self.path)]
        self._reader = readers[0]  # a split set's metadata is in its first part
        self._file: dict[str, Path] = {}
        self._gguf = gguf
        self.arch = self._value("general.architecture")
        if self.arch not in _ARCHS:
            raise ConfigError(f"{self.path}: GGUF architecture {self.arch!r} is not supported "
                              f"(supported: {', '.join(_ARCHS)})")
        self._tensors: dict[str, Any] = {}
        patterns = _patterns(_TABLES[self.arch])
        for part, r in zip(split_parts(self.path), readers, strict=True):
            for t in r.tensors:
                name = _checkpoint_name(t.name, patterns)
                if name is not None:
                    self._tensors[name] = t
                    self._file[name] = part

    # ---------------------------------------------------------------- metadata
    def _value(self, key: str, default: Any = None) -> Any:
        field = self._reader.fields.get(key)
        if field is None:
            if default is None:
                raise ConfigError(f"{self.path}: GGUF metadata key {key!r} is missing")
            return default
        return field.contents()

    def config(self) -> dict[str, Any]:
        """A Hugging Face config dict for the model in the file."""
        a, v = self.arch, self._value
        heads = int(v(f"{a}.attention.head_count"))
        hidden = int(v(f"{a}.embedding_length"))
        head_dim = int(v(f"{a}.attention.key_length", hidden // heads))
        if "model.embed_tokens.weight" not in self._tensors:
            raise WeightError(f"{self.path}: no token_embd.weight")
        experts = "model.layers.0.mlp.experts.gate_proj"
        # the experts' float type, or bfloat16 for quantized experts (the dense dtype the user may override)
        dtype = _FLOAT_TYPES.get(self.qtype(experts), torch.bfloat16) if experts in self._tensors else torch.bfloat16
        cfg: dict[str, Any] = {
            "model_type": _ARCHS[a], "vocab_size": self.shape("model.embed_tokens.weight")[0],
            "hidden_size": hidden, "num_hidden_layers": int(v(f"{a}.block_count")),
            "num_attention_heads": heads, "num_key_value_heads": int(v(f"{a}.attention.head_count_kv")),
            "head_dim": head_dim, "num_experts": int(v(f"{a}.expert_count")),
            "num_experts_per_tok": int(v(f"{a}.expert_used_count")),
            "moe_intermediate_size": int(v(f"{a}.expert_feed_forward_length")),
            "rope_theta": float(v(f"{a}.rope.freq_base", 10000.0)),
            "rms_norm_eps": float(v(f"{a}.attention.layer_norm_rms_epsilon")),
            "max_position_embeddings": int(v(f"{a}.context_length")),
            "tie_word_embeddings": "lm_head.weight" not in self._tensors,
            "torch_dtype": str(dtype).removeprefix("torch."),
        }
        if a == "qwen3moe":
            return {**cfg, "architectures": ["Qwen3MoeForCausalLM"],
                    "intermediate_size": int(v(f"{a}.feed_forward_length", 1)),
                    "norm_topk_prob": True,  # llama.cpp's qwen3moe graph normalises the top-k weights
                    "decoder_sparse_step": 1, "mlp_only_layers": []}
        if a == "glm4moe":
            return {**cfg, **self._glm4moe(cfg)}
        if a == "deepseek2":
            return {**cfg, **self._glm4moe(cfg), **self._deepseek2(cfg)}
        if a == "gpt-oss":
            return {**cfg, **self._gpt_oss(cfg)}
        value_heads = int(v(f"{a}.ssm.time_step_rank"))
        if a == "qwen3next":  # llama.cpp's qwen3next graph normalises the top-k weights
            cfg |= {"architectures": ["Qwen3NextForCausalLM"], "norm_topk_prob": True, "decoder_sparse_step": 1,
                    "mlp_only_layers": []}
        return {"architectures": ["Qwen3_5MoeForCausalLM"], **cfg,
                "partial_rotary_factor": int(v(f"{a}.rope.dimension_count", head_dim)) / head_dim,
                "full_attention_interval": int(v(f"{a}.full_attention_interval", 4)),
                "shared_expert_intermediate_size": int(v(f"{a}.expert_shared_feed_forward_length", 0)),
                "linear_num_key_heads": int(v(f"{a}.ssm.group_count")), "linear_num_value_heads": value_heads,
                "linear_key_head_dim": int(v(f"{a}.ssm.state_size")),
                "linear_value_head_dim": int(v(f"{a}.ssm.inner_size")) // value_heads,
                "linear_conv_kernel_dim": int(v(f"{a}.ssm.conv_kernel"))}

    def _glm4moe(self, cfg: dict[str, Any]) -> dict[str, Any]:
        a, v = self.arch, self._value
        gating = int(v(f"{a}.expert_gating_func", 2))
        if gating != 2:
            raise ConfigError(f"{self.path}: {a} expert_gating_func {gating} is not supported (only 2, sigmoid)")
        return {
            "architectures": ["Glm4MoeForCausalLM"],
            "num_hidden_layers": cfg["num_hidden_layers"] - int(v(f"{a}.nextn_predict_layers", 0)),
            "intermediate_size": int(v(f"{a}.feed_forward_length", 1)),
            "first_k_dense_replace": int(v(f"{a}.leading_dense_block_count", 0)),
            "n_shared_experts": int(v(f"{a}.expert_shared_count", 0)),
            "routed_scaling_factor": float(v(f"{a}.expert_weights_scale", 1.0)),
            "norm_topk_prob": bool(v(f"{a}.expert_weights_norm", False)),
            "n_group": int(v(f"{a}.expert_group_count", 1)), "topk_group": int(v(f"{a}.expert_group_used_count", 1)),
            "partial_rotary_factor": int(v(f"{a}.rope.dimension_count", cfg["head_dim"])) / cfg["head_dim"],
            "use_qk_norm": "model.layers.0.self_attn.q_norm.weight" in self._tensors,
            "attention_bias": "model.layers.0.self_attn.q_proj.bias" in self._tensors,
        }

    def _deepseek2(self, cfg: dict[str, Any]) -> dict[str, Any]:
        a, v = self.arch, self._value
        rope = int(v(f"{a}.rope.dimension_count"))
        mla = f"{a}.attention.key_length_mla" in self._reader.fields
        key = int(v(f"{a}.attention.key_length_mla" if mla else f"{a}.attention.key_length"))
        out: dict[str, Any] = {
            "architectures": ["DeepseekV3ForCausalLM"], "partial_rotary_factor": 1.0, "use_qk_norm": False,
            "num_key_value_heads": cfg["num_attention_heads"], "head_dim": key,
            "q_lora_rank": int(v(f"{a}.attention.q_lora_rank", 0)) or None,
            "kv_lora_rank": int(v(f"{a}.attention.kv_lora_rank")), "qk_rope_head_dim": rope,
            "qk_nope_head_dim": key - rope,
            "v_head_dim": int(v(f"{a}.attention.value_length_mla" if mla else f"{a}.attention.value_length")),
            "rope_interleave": True, "scoring_func": "sigmoid",
            "attention_bias": "model.layers.0.self_attn.kv_a_proj_with_mqa.bias" in self._tensors,
        }
        if str(v(f"{a}.rope.scaling.type", "none")) == "yarn":
            mscale = float(v(f"{a}.rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
            out["rope_scaling"] = {
                "rope_type": "yarn", "factor": float(v(f"{a}.rope.scaling.factor")),
                "original_max_position_embeddings": int(v(f"{a}.rope.scaling.original_context_length")),
                "mscale": mscale or None, "mscale_all_dim": mscale or None, "rope_theta": cfg["rope_theta"]}
        return out

    def _gpt_oss(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """gpt-oss: even layers slide over `attention.sliding_window` tokens (llama.cpp's pattern of
        2), YaRN as released (beta 32 / 1, no truncation), alpha 1.702 and limit 7 (llama.cpp's
        constants: the file does not carry them)."""
        a, v = self.arch, self._value
        n = cfg["num_hidden_layers"]
        out: dict[str, Any] = {
            "architectures": ["GptOssForCausalLM"], "intermediate_size": cfg["moe_intermediate_size"],
            "num_local_experts": cfg["num_experts"], "sliding_window": int(v(f"{a}.attention.sliding_window")),
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
            "attention_bias": True, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
        }
        if str(v(f"{a}.rope.scaling.type", "none")) == "yarn":
            out["rope_scaling"] = {
                "rope_type": "yarn", "factor": float(v(f"{a}.rope.scaling.factor")), "beta_fast": 32.0,
                "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": int(v(f"{a}.rope.scaling.original_context_length")),
                "rope_theta": cfg["rope_theta"]}
        return out

    def _kv_b(self, name: str) -> torch.Tensor:
        """kv_b_proj [heads * (nope + v), kv_lora] from the split attn_k_b / attn_v_b."""
        k_b = self.get(name.replace("kv_b_proj", "k_b_proj"))  # [heads, kv_lora, nope]
        v_b = self.get(name.replace("kv_b_proj", "v_b_proj"))  # [heads, v, kv_lora]
        return torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(-1, k_b.shape[1])

    def _split_kv_b(self, name: str) -> bool:
        return (name.endswith("self_attn.kv_b_proj.weight") and name not in self._tensors
                and name.replace("kv_b_proj", "k_b_proj") in self._tensors)

    def _ba_source(self, name: str) -> str | None:
        """qwen3next: in_proj_a / in_proj_b, read out of in_proj_ba (per key head: its value heads' b
        rows, then their a rows, as Hugging Face's Qwen3-Next stores it)."""
        if self.arch != "qwen3next" or not name.endswith(("linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight")):
            return None
        src = name.rsplit(".in_proj_", 1)[0] + ".in_proj_ba.weight"
        return src if src in self._tensors else None

    def _ba_part(self, name: str, src: str) -> torch.Tensor:
        kh = int(self._value(f"{self.arch}.ssm.group_count"))
        ba = self.get(src)
        per = ba.shape[0] // (2 * kh)
        part = ba.view(kh, 2 * per, -1)
        return (part[:, per:] if name.endswith("in_proj_a.weight") else part[:, :per]).reshape(kh * per, -1)

    def _grouped_heads(self) -> torch.Tensor:
        """For each value head in grouped order (Hugging Face's), its index in tiled order (llama.cpp's)."""
        kh, vh = int(self._value(f"{self.arch}.ssm.group_count")), int(self._value(f"{self.arch}.ssm.time_step_rank"))
        rep = vh // kh
        j = torch.arange(vh)
        return (j % rep) * kh + j // rep

    def _to_checkpoint(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """llama.cpp's qwen35moe conventions -> the checkpoint's (see the module docstring)."""
        if name.endswith(_CENTRED):
            return t - 1
        if not name.startswith("model.layers.") or ".linear_attn." not in name:
            return t.reshape(1, -1) if name.endswith("shared_expert_gate.weight") else t
        kind = name.rsplit(".linear_attn.", 1)[1]
        if kind == "A_log":
            t = torch.log(-t.float())
        if self.arch == "qwen3next":  # its value heads are in grouped order already
            return t.reshape(t.shape[0], 1, -1) if kind == "conv1d.weight" else t
        perm = self._grouped_heads()
        if kind in ("A_log", "dt_bias", "in_proj_a.weight", "in_proj_b.weight"):
            return t[perm]
        head = int(self._value(f"{self.arch}.ssm.inner_size")) // len(perm)
        rows = (perm[:, None] * head + torch.arange(head)).reshape(-1)  # value channels, grouped order
        if kind == "in_proj_z.weight":
            return t[rows]
        if kind in ("in_proj_qkv.weight", "conv1d.weight"):
            key_dim = t.shape[0] - len(rows)
            t = torch.cat([t[:key_dim], t[key_dim:][rows]])
            return t.reshape(t.shape[0], 1, -1) if kind == "conv1d.weight" else t
        if kind == "out_proj.weight":
            return t[:, rows]
        return t

    # ---------------------------------------------------------------- CheckpointReader's interface
    def names(self) -> list[str]:
        return list(self._tensors)

    def has(self, name: str) -> bool:
        return name in self._tensors or self._split_kv_b(name) or self._ba_source(name) is not None

    def shape(self, name: str) -> tuple[int, ...]:
        if self._split_kv_b(name):
            k_b, v_b = (self.shape(name.replace("kv_b_proj", x)) for x in ("k_b_proj", "v_b_proj"))
            return (k_b[0] * (k_b[2] + v_b[1]), k_b[1])
        if (ba := self._ba_source(name)) is not None:
            rows, cols = self.shape(ba)
            return (rows // 2, cols)
        # GGUF lists dimensions fastest first; a row-major tensor's shape is the reverse
        shape = tuple(int(d) for d in reversed(self._tensors[name].shape.tolist()))
        if name.endswith("linear_attn.conv1d.weight"):
            return (shape[0], 1, shape[1])  # the checkpoint's depthwise Conv1d layout
        if name.endswith("shared_expert_gate.weight"):
            return (1, shape[0])
        return shape

    def file_of(self, name: str) -> Path:
        return self._file.get(name, self.path)

    def nbytes(self, name: str) -> int:
        if self._split_kv_b(name):
            return sum(self.nbytes(name.replace("kv_b_proj", x)) for x in ("k_b_proj", "v_b_proj"))
        if (ba := self._ba_source(name)) is not None:
            return self.nbytes(ba) // 2
        return int(self._tensors[name].n_bytes)

    def qtype(self, name: str) -> str:
        """The tensor's GGML type name (`F32`, `Q4_K`, ...)."""
        return str(self._gguf.GGMLQuantizationType(self._tensors[name].tensor_type).name)

    def _kind(self, t: Any) -> str:
        kind = str(self._gguf.GGMLQuantizationType(t.tensor_type).name)
        if kind not in _FLOAT_TYPES and kind not in GGML_FORMATS:
            raise WeightError(f"{self._where(t)}: tensor {t.name!r} is {kind}; supported: "
                              f"{', '.join([*_FLOAT_TYPES, *GGML_FORMATS])}")
        return kind

    def _where(self, t: Any) -> Path:
        return next((self._file[n] for n, v in self._tensors.items() if v is t), self.path)

    def _tensor_dtype(self, t: Any) -> torch.dtype:
        kind = self._kind(t)
        return _FLOAT_TYPES.get(kind, torch.float32)  # a quantized tensor dequantizes to float32

    def packed(self, name: str) -> tuple[str, torch.Tensor]:
        """(format, uint8 rows [..., row_bytes]) of a quantized tensor, a view of the mapped file."""
        t = self._tensors.get(name)
        if t is None:
            raise WeightError(f"{self.path}: missing tensor {name!r}")
        kind = self._kind(t)
        if kind not in GGML_FORMATS:
            raise WeightError(f"{self._where(t)}: tensor {t.name!r} is {kind}, not a quantized type")
        with warnings.catch_warnings():  # a read-only view of the mapped file: the loader only copies from it
            warnings.simplefilter("ignore", UserWarning)
            return GGML_FORMATS[kind], torch.from_numpy(np.asarray(t.data))

    # ---------------------------------------------------------------- packed experts (engine/weights/packed.py)
    def expert_format(self, prefix: str) -> str | None:
        t = self._tensors.get(prefix + "gate_proj", self._tensors.get(prefix + "gate_up_proj"))
        return None if t is None else GGML_FORMATS.get(self._kind(t))  # an unsupported type raises here

    def expert_rows(self, prefix: str, proj: str, experts: int, rows: int, cols: int) -> tuple[str, torch.Tensor, torch.Tensor]:
        from engine.weights.packed import check_rows

        name = prefix + proj
        fused = proj != "down_proj" and name not in self._tensors and prefix + "gate_up_proj" in self._tensors
        if fused:  # one [E, 2I, H] tensor: gate rows, then up rows
            name, rows = prefix + "gate_up_proj", 2 * rows
        t = self._tensors.get(name)
        if t is None:
            raise WeightError(f"{self.path}: missing tensor {name!r}")
        if self.shape(name) != (experts, rows, cols):
            raise WeightError(f"{self.file_of(name)}: tensor {t.name!r} has shape {list(self.shape(name))}, "
                              f"expected {[experts, rows, cols]}")
        fmt, data = self.packed(name)
        what = f"{self.file_of(name)}: tensor {t.name!r} ({self.qtype(name)})"
        data = check_rows(what, fmt, data, (experts, rows), cols)
        if fused:
            data = data[:, : rows // 2] if proj == "gate_proj" else data[:, rows // 2:]
        return fmt, data, torch.ones(experts)

    def get(self, name: str) -> torch.Tensor:
        if self._split_kv_b(name):
            return self._kv_b(name)
        if (ba := self._ba_source(name)) is not None:
            return self._ba_part(name, ba)
        t = self._tensors.get(name)
        if t is None:
            raise WeightError(f"{self.path}: missing tensor {name!r}")
        kind = self._kind(t)
        data = np.asarray(t.data)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if kind in GGML_FORMATS:
            out = FORMATS[GGML_FORMATS[kind]].dequantize(torch.from_numpy(data), shape[-1])
        elif kind == "BF16":  # numpy has no bf16: the reader gives the raw 16-bit words
            out = torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16)
        else:
            out = torch.from_numpy(data.copy())
        out = out.reshape(shape)
        if self.arch in ("qwen35moe", "qwen3next"):
            out = self._to_checkpoint(name, out)
        return out.reshape(self.shape(name))

    def close(self) -> None:
        self._tensors.clear()
