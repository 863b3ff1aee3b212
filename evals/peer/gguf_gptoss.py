"""write_gguf.py --arch gpt-oss: gpt-oss's tensors, types, keys and tokenizer, gpt-oss-120b's shape by default.

Contract: what llama.cpp (commit 0c1e57098, src/models/openai-moe.cpp, LLM_ARCH_OPENAI_MOE = "gpt-oss")
loads, laid out as the released MXFP4 GGUFs of gpt-oss are (their loader logs: 36 layers give 433 F32,
146 Q8_0 and 108 MXFP4 tensors, general.file_type 38 = MOSTLY_MXFP4_MOE):
- `tensors(args, vocab)` lists (name, numpy shape (the reverse of ggml's ne), kind, fill, role) in
  write_gguf.TensorSpec's terms: `token_embd` and the untied `output` [vocab, hidden]; per block
  `attn_norm`, `post_attention_norm`, separate `attn_q` / `attn_k` / `attn_v` [heads x head_dim,
  hidden] with a bias each, `attn_output` [hidden, heads x head_dim] with its bias, `attn_sinks.weight`
  [heads], the router `ffn_gate_inp` [experts, hidden] with its bias, the expert banks
  `ffn_gate_exps` / `ffn_up_exps` [experts, inter, hidden] and `ffn_down_exps` [experts, hidden, inter],
  each with a `.bias` [experts, rows]. No tensor more (llama.cpp refuses a file with unused tensors).
- `tensor_types(specs)`: the expert banks MXFP4, every other matrix (attention, embedding, output) Q8_0,
  the router, norms, biases and sinks F32.
- `add_hparams(writer, arch, args)`: the keys the released files carry (context_length,
  embedding_length, block_count, feed_forward_length (= the expert size), head counts, key/value
  length (= head_dim: no rope.dimension_count, llama.cpp rotates the whole head), rope.freq_base,
  rms epsilon, expert counts, expert_feed_forward_length, attention.sliding_window, rope.scaling.type
  yarn with its factor and original_context_length). llama.cpp slides on even layers (its pattern of
  2); engine/weights/gguf_reader.py reads the same keys.
- `add_o200k_harmony(writer)` -> vocabulary size: the tokenizer keys as llama.cpp's converter writes
  gpt-oss's (tokenizer.ggml.model gpt2, pre gpt-4o, 201088 tokens by id (o200k_base's 199998 byte-level
  tokens, then harmony's 1090 specials as control tokens), merges, bos <|startoftext|>, eos <|return|>,
  padding <|endoftext|>, tokenizer.chat_template), built by freetoken_agent.tokenizer.build from the
  ranks the bpe-openai package ships. Its merges are derived from the ranks (199742 of them; the
  released file lists 446189, redundant ones included): the token list is o200k_harmony's exactly.
  `python3 evals/peer/gguf_gptoss.py --vocab-out PATH` writes those keys alone into a vocabulary GGUF
  (as llama.cpp's models/ggml-vocab-*.gguf), for write_gguf.py --vocab-from on a machine without
  bpe-openai.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import gguf_quant as gq

REPO = Path(__file__).resolve().parents[2]
# gpt-oss-120b (engine/weights/shapes.py "gpt-oss-120b"); its vocabulary (201088) is the tokenizer's
GPT_OSS_120B: dict[str, Any] = dict(
    layers=36, experts=128, top_k=4, hidden=2880, inter=2880, heads=64, kv_heads=8, head_dim=64, ctx=131072,
    rope_base=150000.0, rms_eps=1e-5, sliding_window=128, yarn_factor=32.0, yarn_orig_ctx=4096)
OPTIONS = ("sliding_window", "yarn_factor", "yarn_orig_ctx")
O200K_HARMONY_SIZE = 201088


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sliding-window", type=int, default=None, help="gpt-oss: sliding window of the even layers (128)")
    p.add_argument("--yarn-factor", type=float, default=None, help="gpt-oss: YaRN rope scaling factor (32)")
    p.add_argument("--yarn-orig-ctx", type=int, default=None, help="gpt-oss: YaRN original context length (4096)")


Spec = tuple[str, tuple[int, ...], str, float, str]


def tensors(a: argparse.Namespace, vocab: int) -> list[Spec]:
    h, e, inter = a.hidden, a.experts, a.inter
    q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
    out: list[Spec] = [("token_embd.weight", (vocab, h), "mat", 0.0, "embed"),
                       ("output_norm.weight", (h,), "norm", 0.0, ""), ("output.weight", (vocab, h), "mat", 0.0, "")]
    for i in range(a.layers):
        b = f"blk.{i}."
        out += [
            (b + "attn_norm.weight", (h,), "norm", 0.0, ""),
            (b + "post_attention_norm.weight", (h,), "norm", 0.0, ""),
            (b + "attn_q.weight", (q, h), "mat", 0.0, ""), (b + "attn_q.bias", (q,), "vec", 0.0, ""),
            (b + "attn_k.weight", (kv, h), "mat", 0.0, ""), (b + "attn_k.bias", (kv,), "vec", 0.0, ""),
            (b + "attn_v.weight", (kv, h), "mat", 0.0, ""), (b + "attn_v.bias", (kv,), "vec", 0.0, ""),
            (b + "attn_output.weight", (h, q), "mat", 0.0, "residual"), (b + "attn_output.bias", (h,), "vec", 0.0, ""),
            (b + "attn_sinks.weight", (a.heads,), "vec", 0.0, ""),
            (b + "ffn_gate_inp.weight", (e, h), "router", 0.0, ""), (b + "ffn_gate_inp.bias", (e,), "vec", 0.0, ""),
            (b + "ffn_gate_exps.weight", (e, inter, h), "mat", 0.0, ""), (b + "ffn_gate_exps.bias", (e, inter), "vec", 0.0, ""),
            (b + "ffn_up_exps.weight", (e, inter, h), "mat", 0.0, ""), (b + "ffn_up_exps.bias", (e, inter), "vec", 0.0, ""),
            (b + "ffn_down_exps.weight", (e, h, inter), "mat", 0.0, "residual"),
            (b + "ffn_down_exps.bias", (e, h), "vec", 0.0, ""),
        ]
    return out


def tensor_types(specs: list[tuple[str, tuple[int, ...], str]]) -> dict[str, int]:
    """{name: ggml type} for (name, shape, kind) triples: MXFP4 expert banks, Q8_0 other matrices, F32 the rest."""
    out: dict[str, int] = {}
    for name, shape, kind in specs:
        if kind != "mat":
            out[name] = gq.F32
            continue
        qtype = gq.MXFP4 if "_exps." in name else gq.Q8_0
        gq.row_bytes(qtype, shape[-1])  # raises when a row is not whole blocks of 32
        out[name] = qtype
    return out


def check(a: argparse.Namespace) -> None:
    if a.hidden % 32 or a.inter % 32 or (a.heads * a.head_dim) % 32:
        raise SystemExit("write_gguf.py: gpt-oss's MXFP4 / Q8_0 rows are blocks of 32: --hidden, --inter and "
                         "--heads x --head-dim must be multiples of 32")
    if a.heads % a.kv_heads or a.sliding_window < 1:
        raise SystemExit("write_gguf.py: gpt-oss needs --heads a multiple of --kv-heads and --sliding-window >= 1")


def add_hparams(writer: Any, arch: str, a: argparse.Namespace) -> None:
    check(a)
    u32 = {"context_length": a.ctx, "embedding_length": a.hidden, "block_count": a.layers,
           "feed_forward_length": a.inter, "attention.head_count": a.heads, "attention.head_count_kv": a.kv_heads,
           "expert_count": a.experts, "expert_used_count": a.top_k, "attention.key_length": a.head_dim,
           "attention.value_length": a.head_dim, "attention.sliding_window": a.sliding_window,
           "expert_feed_forward_length": a.inter, "rope.scaling.original_context_length": a.yarn_orig_ctx}
    for key, value in u32.items():
        writer.add_uint32(f"{arch}.{key}", int(value))
    writer.add_float32(f"{arch}.rope.freq_base", a.rope_base)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", a.rms_eps)
    writer.add_string(f"{arch}.rope.scaling.type", "yarn")
    writer.add_float32(f"{arch}.rope.scaling.factor", a.yarn_factor)


def add_o200k_harmony(writer: Any) -> int:
    try:
        from freetoken_agent.tokenizer.build import build_tokenizer_json, chat_template
    except ImportError:
        sys.path.insert(0, str(REPO))
        try:
            from freetoken_agent.tokenizer.build import build_tokenizer_json, chat_template
        except ImportError as e:
            raise SystemExit(f"write_gguf.py: building o200k_harmony needs freetoken_agent and bpe-openai ({e}); "
                             "or pass --vocab-from a vocabulary GGUF (python3 evals/peer/gguf_gptoss.py "
                             "--vocab-out PATH writes one)") from None
    doc = build_tokenizer_json("gpt_oss")
    ids = {**doc["model"]["vocab"], **{t["content"]: t["id"] for t in doc["added_tokens"]}}
    tokens = sorted(ids, key=ids.__getitem__)
    if [ids[t] for t in tokens] != list(range(len(tokens))):
        raise SystemExit("write_gguf.py: o200k_harmony's ids are not 0..n-1")
    control = {t["content"] for t in doc["added_tokens"] if t["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-4o")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in control else 1 for t in tokens])  # llama_token_type: 1 normal, 3 control
    writer.add_token_merges(doc["model"]["merges"])
    writer.add_bos_token_id(ids["<|startoftext|>"])
    writer.add_eos_token_id(ids["<|return|>"])
    writer.add_pad_token_id(ids["<|endoftext|>"])
    writer.add_chat_template(chat_template("gpt_oss"))
    return len(tokens)


def write_vocab(path: Path) -> int:
    """A GGUF holding only o200k_harmony's tokenizer keys; returns the vocabulary size."""
    import gguf

    w = gguf.GGUFWriter(str(path), "gpt-oss")
    n = add_o200k_harmony(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Write o200k_harmony's tokenizer keys into a vocabulary GGUF.")
    p.add_argument("--vocab-out", type=Path, required=True)
    args = p.parse_args(argv)
    args.vocab_out.parent.mkdir(parents=True, exist_ok=True)
    n = write_vocab(args.vocab_out)
    print(f"gguf_gptoss: {args.vocab_out}: o200k_harmony, {n} tokens, {args.vocab_out.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
