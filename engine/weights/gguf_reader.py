"""Read a GGUF file (llama.cpp's format) as if it were a Hugging Face checkpoint.

Contract: `GgufReader(path)` opens a `.gguf` file with the `gguf` package (memory-mapped, nothing
read up front) and answers like `CheckpointReader` (engine/weights/reader.py): `names()`, `has`,
`shape`, `nbytes`, `file_of`, `get(name)` under the checkpoint names `load_weights` asks for, so
the same loader fills the same layout; `config()` is the model's config as a Hugging Face
config dict, built from the GGUF metadata. Supported: the `qwen3moe` architecture (Qwen3-MoE) in
F32, F16 or BF16; the tensors map one to one (llama.cpp stores Qwen3's projections unpermuted,
NEOX rotary, softmax routing with normalised top-k weights, as Hugging Face does). Anything else
(another architecture, a quantised tensor) raises `ConfigError` / `WeightError` naming it.
Needs the `gguf` package (`pip install gguf`).

Why: the peer benchmark (evals/peer/) runs llama.cpp on a GGUF; reading the same file gives both
systems the same weights, byte for byte.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.errors import ConfigError, WeightError

_ARCHS = {"qwen3moe": "qwen3_moe"}
# GGUF tensor name (with {i} for the block) -> checkpoint name
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
}
_PATTERNS = [(re.compile("^" + re.escape(g).replace(r"\{i\}", r"(\d+)") + "$"), h) for g, h in _NAMES.items()]
_FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _import_gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise ConfigError("reading a .gguf model needs the gguf package: pip install gguf") from None
    return gguf


def _checkpoint_name(gguf_name: str) -> str | None:
    for pattern, target in _PATTERNS:
        m = pattern.match(gguf_name)
        if m:
            return target.format(i=m.group(1)) if m.groups() else target
    return None


class GgufReader:
    def __init__(self, path: Path | str) -> None:
        gguf = _import_gguf()
        self.path = Path(path)
        self.model_dir = self.path  # what error messages name
        try:
            self._reader = gguf.GGUFReader(str(self.path), "r")
        except FileNotFoundError:
            raise WeightError(f"{self.path}: file not found") from None
        except Exception as e:  # gguf raises ValueError and friends for a bad file
            raise WeightError(f"{self.path}: not a readable GGUF file ({e})") from None
        self._gguf = gguf
        self.arch = self._value("general.architecture")
        if self.arch not in _ARCHS:
            raise ConfigError(f"{self.path}: GGUF architecture {self.arch!r} is not supported "
                              f"(supported: {', '.join(_ARCHS)})")
        self._tensors: dict[str, Any] = {}
        for t in self._reader.tensors:
            name = _checkpoint_name(t.name)
            if name is not None:
                self._tensors[name] = t

    # ---------------------------------------------------------------- metadata
    def _value(self, key: str, default: Any = None) -> Any:
        field = self._reader.fields.get(key)
        if field is None:
            if default is None:
                raise ConfigError(f"{self.path}: GGUF metadata key {key!r} is missing")
            return default
        value = field.contents()
        return value

    def config(self) -> dict[str, Any]:
        """A Hugging Face config dict for the model in the file."""
        a = self.arch
        heads = int(self._value(f"{a}.attention.head_count"))
        hidden = int(self._value(f"{a}.embedding_length"))
        if "model.embed_tokens.weight" not in self._tensors:
            raise WeightError(f"{self.path}: no token_embd.weight")
        vocab = self.shape("model.embed_tokens.weight")[0]
        dtype = self._tensor_dtype(self._tensors["model.layers.0.mlp.experts.gate_proj"]) \
            if "model.layers.0.mlp.experts.gate_proj" in self._tensors else torch.bfloat16
        return {
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": _ARCHS[a],
            "vocab_size": vocab, "hidden_size": hidden,
            "num_hidden_layers": int(self._value(f"{a}.block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self._value(f"{a}.attention.head_count_kv")),
            "head_dim": int(self._value(f"{a}.attention.key_length", hidden // heads)),
            "num_experts": int(self._value(f"{a}.expert_count")),
            "num_experts_per_tok": int(self._value(f"{a}.expert_used_count")),
            "moe_intermediate_size": int(self._value(f"{a}.expert_feed_forward_length")),
            "intermediate_size": int(self._value(f"{a}.feed_forward_length", 1)),
            "rope_theta": float(self._value(f"{a}.rope.freq_base", 10000.0)),
            "rms_norm_eps": float(self._value(f"{a}.attention.layer_norm_rms_epsilon")),
            "max_position_embeddings": int(self._value(f"{a}.context_length")),
            "norm_topk_prob": True,  # llama.cpp's qwen3moe graph normalises the top-k weights
            "decoder_sparse_step": 1, "mlp_only_layers": [],
            "tie_word_embeddings": "lm_head.weight" not in self._tensors,
            "torch_dtype": str(dtype).removeprefix("torch."),
        }

    # ---------------------------------------------------------------- CheckpointReader's interface
    def names(self) -> list[str]:
        return list(self._tensors)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def shape(self, name: str) -> tuple[int, ...]:
        # GGUF lists dimensions fastest first; a row-major tensor's shape is the reverse
        return tuple(int(d) for d in reversed(self._tensors[name].shape.tolist()))

    def file_of(self, name: str) -> Path:
        return self.path

    def nbytes(self, name: str) -> int:
        return int(self._tensors[name].n_bytes)

    def _tensor_dtype(self, t: Any) -> torch.dtype:
        kind = self._gguf.GGMLQuantizationType(t.tensor_type).name
        if kind not in _FLOAT_TYPES:
            raise WeightError(f"{self.path}: tensor {t.name!r} is {kind}; only F32, F16 and BF16 are supported")
        return _FLOAT_TYPES[kind]

    def get(self, name: str) -> torch.Tensor:
        t = self._tensors.get(name)
        if t is None:
            raise WeightError(f"{self.path}: missing tensor {name!r}")
        dtype = self._tensor_dtype(t)
        data = np.asarray(t.data)
        if dtype == torch.bfloat16:  # numpy has no bf16: the reader gives the raw 16-bit words
            out = torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16)
        else:
            out = torch.from_numpy(data.copy())
        return out.reshape(self.shape(name))

    def close(self) -> None:
        self._tensors.clear()
