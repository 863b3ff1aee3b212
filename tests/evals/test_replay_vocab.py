"""The Qwen3.6 vocabulary GGUF of the GPU replay (evals/gpu/replay_vocab.py): the tokenizer our server
reads back from it (freetoken_agent/tokenizer/gguf.py) encodes, decodes and renders the chat exactly
as the tokenizer directory written beside it, which `eval replay --tokenizer` accepts; special tokens
are CONTROL and the other added ones USER_DEFINED, as llama.cpp's converter writes them."""

from __future__ import annotations

from pathlib import Path

from evals.gpu.replay_vocab import write_vocab
from evals.traces.replay import Renderer
from freetoken_agent.models import load_tokenizer, resolve_model
from freetoken_agent.tokenizer import ChatTokenizer
from freetoken_agent.tokenizer.gguf import _fields

TEXTS = ["Hello, world!", "def f(x):\n    return x  # 中文 ünïcödé\r\n",
         "<|im_start|>user\nhi<|im_end|>", "<think>why</think>\n<tool_call>\n<function=read>\n</tool_call>"]


def test_vocab_gguf_reads_back_as_the_directory(tmp_path: Path) -> None:
    out = write_vocab(tmp_path / "vocab")
    ref = ChatTokenizer.from_dir(resolve_model(str(out)))  # a model directory for `--tokenizer`
    ours = load_tokenizer(out / "vocab.gguf")
    for text in TEXTS:
        ids = ref.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == text
    assert ours.chat_template == ref.chat_template and "tools" in (ours.chat_template or "")
    assert (ours.eos_token_id, ours.pad_token_id) == (ref.eos_token_id, ref.pad_token_id)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(msgs, add_generation_prompt=True) == ref.apply_chat_template(
        msgs, add_generation_prompt=True)
    fields = _fields(out / "vocab.gguf")  # the loader's header reader (gguf's parses 248k items slowly)
    tokens, types = list(fields["tokenizer.ggml.tokens"]), list(fields["tokenizer.ggml.token_type"])
    assert fields["tokenizer.ggml.pre"] == "qwen35" and len(tokens) == len(types) == 248320
    kind = {t: types[tokens.index(t)] for t in ("<|im_end|>", "<think>", "Hello")}
    assert kind == {"<|im_end|>": 3, "<think>": 4, "Hello": 1}
    # `eval replay --tokenizer` takes the GGUF file as well as the directory: the same prompt ids
    body = {"model": "m", "messages": msgs, "tools": [{"type": "function", "function": {
        "name": "read", "description": "read a file", "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}}, "required": ["path"]}}}]}
    want = Renderer(str(out)).prompt_ids("/v1/chat/completions", body)
    assert Renderer(str(out / "vocab.gguf")).prompt_ids("/v1/chat/completions", body) == want
    assert len(want) > len(ref.encode("be brief hi")) + 20  # the tool schema is in the prompt
