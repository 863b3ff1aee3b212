"""`bench cpu-experts --format F` runs every packed format (freetoken_agent/bench/packed_experts.py):
one JSON object per run, the packed kernel's rate over the exact bytes of the experts it read."""

from __future__ import annotations

import argparse
import json

import pytest

from freetoken_agent.bench.cpu_experts import PACKED_FORMATS, add_parser
from freetoken_agent.bench.packed_experts import run_packed


def test_packed_formats_are_the_registry() -> None:
    from engine.quant.formats import PACKED

    assert set(PACKED_FORMATS) == set(PACKED)


@pytest.mark.parametrize("fmt", ["q4_k", "q8_0", "nvfp4"])
def test_bench_runs_a_packed_format(fmt: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["cpu-experts", "--format", fmt, "--threads", "1", "--seconds", "0.01", "--rounds", "1",
                              "--json", "--no-torch"])
    assert run_packed(args, hidden=256, inter=256, top_k=2, bank_gb=0.002) == 0
    r = json.loads(capsys.readouterr().out)
    from engine.quant.formats import FORMATS

    per_expert = 3 * 256 * FORMATS[fmt].row_bytes(256)
    assert r["format"] == fmt and r["bytes_per_call"] == 2 * per_expert and r["weight_gbps"] > 0
