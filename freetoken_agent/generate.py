"""`freetoken-agent generate`: one prompt through the engine, text streamed to stdout.

Contract: greedy unless a temperature is given; with `--output-ids` the generated ids are printed
as one JSON list on the last line. The prompt goes through the model's chat template as a user
message unless `--raw`.
"""

from __future__ import annotations

import argparse
import json
import sys

from engine.engine import Engine
from engine.errors import RequestError
from engine.sampling import SamplingParams
from freetoken_agent.argtypes import engine_options, resolve_gpu_memory
from freetoken_agent.calibrate import calibration_path
from freetoken_agent.models import resolve_model
from freetoken_agent.progress import load_progress
from freetoken_agent.tokenizer import ChatTokenizer, StreamDecoder


def run_generate(args: argparse.Namespace) -> int:
    if not args.prompt:
        raise RequestError("prompt is empty")
    with load_progress("preparing model") as progress:
        progress(0, 1)
        model_dir = resolve_model(args.model)
        progress(1, 1)
    tok = ChatTokenizer.from_dir(model_dir)
    if args.raw:
        ids = tok.encode(args.prompt)
    else:
        ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                      enable_thinking=not args.no_think, tokenize=True)
    temperature = args.temperature or 0.0
    params = SamplingParams(max_tokens=args.max_tokens, temperature=temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    with load_progress("loading weights") as progress:
        opts = engine_options(args, device=args.device, gpu_memory=resolve_gpu_memory(args.gpu_memory, args.device),
                              calibration_file=str(calibration_path()))
        engine = Engine(model_dir, opts, progress=progress)
    print(f"expert executor: {engine.decoder.executor.describe()}", file=sys.stderr)
    out_ids: list[int] = []
    decoder = StreamDecoder(tok)
    try:
        for token in engine.generate(ids, params):
            out_ids.append(token)
            text = decoder.push(token)
            if text:
                sys.stdout.write(text)
                sys.stdout.flush()
        sys.stdout.write(decoder.flush() + "\n")
    finally:
        engine.close()
    if args.output_ids:
        print(json.dumps(out_ids))
    return 0
