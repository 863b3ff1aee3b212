"""Qwen3.5 / 3.6's tokenizer and chat template as a tokenizer directory and a vocabulary GGUF, for the
GPU replay side by side (evals/gpu/run_replay.sh).

Contract:
    python3 -m evals.gpu.replay_vocab --out DIR
writes DIR/tokenizer.json, tokenizer_config.json and chat_template.jinja (the project's `qwen3_5`
tokenizer: freetoken_agent/tokenizer/build.py, the real 248320-id vocabulary and the family's chat
template), a config.json naming only the model type (so `--tokenizer DIR` passes as a model
directory; `eval replay --tokenizer` takes DIR/vocab.gguf as well) and
DIR/vocab.gguf holding only `tokenizer.*` keys as llama.cpp's converter writes them:
model `gpt2`, pre-tokenizer `qwen35`, every token by id (padding ids up to the model's padded size as
`[PAD<id>]`), added tokens CONTROL (3) when special else USER_DEFINED (4), merges, eos / pad ids and
the chat template (written as vocab.gguf.part, renamed when whole). `evals/peer/write_gguf.py
--vocab-from DIR/vocab.gguf` then writes a model file whose tokenizer and template are Qwen3.6's,
so both servers render the traces' tools and messages as that model would (the default qwen2 vocabulary's template drops the tools); DIR is the
`eval replay --tokenizer` that counts the same tokens. Prints DIR.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def write_vocab(out: Path) -> Path:
    import gguf

    from freetoken_agent.tokenizer.build import FAMILIES, write_tokenizer

    info = write_tokenizer(out, "qwen3_5")
    doc = json.loads((out / "tokenizer.json").read_text())
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    vocab = dict(doc["model"]["vocab"])
    special = {t["content"] for t in doc["added_tokens"] if t.get("special")}
    vocab.update({t["content"]: t["id"] for t in doc["added_tokens"]})
    by_id = {i: t for t, i in vocab.items()}
    size = max(FAMILIES["qwen3_5"].padded_vocab_size, 1 + max(by_id))
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(size)]
    added = {t["content"] for t in doc["added_tokens"]}
    types = [3 if t in special else 4 if t in added or i not in by_id else 1 for i, t in enumerate(tokens)]
    merges = doc["model"]["merges"]
    (out / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "tokenizer_only": True}) + "\n")
    part = out / "vocab.gguf.part"  # renamed when whole: a killed write leaves no vocab.gguf
    w = gguf.GGUFWriter(str(part), "qwen35moe")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen35")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges if not merges or isinstance(merges[0], str) else [" ".join(m) for m in merges])
    w.add_eos_token_id(info.eos_token_id)
    w.add_pad_token_id(info.pad_token_id)
    w.add_chat_template(cfg["chat_template"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    part.replace(out / "vocab.gguf")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    print(write_vocab(p.parse_args(argv).out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
