"""`freetoken-agent generate`: one prompt through the engine, the reply streamed to stdout.

Contract: greedy unless a temperature is given. The prompt goes through the model's chat template
as a user message, and the reply is rendered as the server renders it: control tokens (`<|im_end|>`
and the like) are not printed, the reasoning (the think block) goes to stderr, the answer to stdout
(the same output parser as the HTTP server, `adapters.parsers`). With `--raw` the prompt is fed as
is and every generated token is printed as text. With `--output-ids` the generated ids are printed
as one JSON list on the last line of stdout. `--device auto` picks CUDA when present.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TextIO


class _Reasoning:
    """Writes reasoning pieces to stderr inside a `thinking:` block (dim on a terminal)."""

    def __init__(self, out: TextIO) -> None:
        self.out, self.open = out, False
        self.dim = out.isatty()

    def write(self, text: str) -> None:
        if not self.open:
            self.out.write("\x1b[2mthinking: " if self.dim else "thinking: ")
            self.open = True
        self.out.write(text)
        self.out.flush()

    def close(self) -> None:
        if self.open:
            self.out.write("\x1b[0m\n" if self.dim else "\n")
            self.out.flush()
            self.open = False


def run_generate(args: argparse.Namespace) -> int:
    from engine.engine import Engine
    from engine.errors import RequestError
    from engine.sampling import SamplingParams
    from freetoken_agent.argtypes import engine_options, resolve_gpu_memory
    from freetoken_agent.calibrate import calibration_path
    from freetoken_agent.models import load_tokenizer, resolve_model
    from freetoken_agent.progress import load_progress
    from freetoken_agent.serve import resolve_device
    from freetoken_agent.service.chat import opens_reasoning, parser_family, render_prompt
    from freetoken_agent.tokenizer import StreamDecoder

    if not args.prompt:
        raise RequestError("prompt is empty")
    model_dir = resolve_model(args.model)
    device = resolve_device(args.device)
    with load_progress("reading the tokenizer"):
        tok = load_tokenizer(model_dir)
    thinking = not args.no_think
    prompt = args.prompt if args.raw else render_prompt(tok, [{"role": "user", "content": args.prompt}], None,
                                                        thinking, None)
    ids = tok.encode(prompt)
    temperature = args.temperature or 0.0
    params = SamplingParams(max_tokens=args.max_tokens, temperature=temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    opts = engine_options(args, device=device, gpu_memory=resolve_gpu_memory(args.gpu_memory, device),
                          calibration_file=str(calibration_path()))
    with load_progress("loading weights") as progress:
        engine = Engine(model_dir, opts, progress=progress)
    print(f"device: {device}; expert executor: {engine.decoder.executor.describe()}", file=sys.stderr)
    parser = None
    if not args.raw:
        from adapters.parsers import ContentDelta, ReasoningDelta, create_parser

        family = parser_family(engine.cfg.family, tok.chat_template)
        parser = create_parser(family, None, starts_in_reasoning=opens_reasoning(prompt))
    reasoning = _Reasoning(sys.stderr)

    def show(text: str, final: bool = False) -> None:
        if parser is None:
            sys.stdout.write(text)
            sys.stdout.flush()
            return
        for event in parser.feed(text) + (parser.finish() if final else []):
            if isinstance(event, ReasoningDelta):
                reasoning.write(event.text)
            elif isinstance(event, ContentDelta):
                reasoning.close()
                sys.stdout.write(event.text)
                sys.stdout.flush()

    out_ids: list[int] = []
    # harmony's structure is special tokens: its parser reads them
    decoder = StreamDecoder(tok, skip_special_tokens=not args.raw and engine.cfg.family != "gpt_oss")
    try:
        for token in engine.generate(ids, params):
            out_ids.append(token)
            text = decoder.push(token)
            if text:
                show(text)
        show(decoder.flush(), final=True)
        reasoning.close()
        sys.stdout.write("\n")
    finally:
        engine.close()
    if args.output_ids:
        print(json.dumps(out_ids))
    return 0
