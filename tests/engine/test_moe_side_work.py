"""The shared expert queued inside the routed step (engine/model/moe.py `moe_block` in a captured
pass, with an executor whose `with_side_work` queues it inside its step, as the GPU expert cache's
does): the side work runs inside the executor's call, exactly once, and the block's output is bit
for bit the one of the plain call (the shared expert's gate, product and sum are the same ops on
the same inputs), in float32 and bfloat16; a block without a shared expert never asks for side
work, and an executor without side work of its own runs the plain call then the side work."""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.model.moe import moe_block
from engine.moe.base import ExpertExecutor
from engine.moe.executor import TorchExpertExecutor
from engine.weights.layout import ExpertBanks, MlpWeights, MoeWeights


def _cfg() -> ModelConfig:
    from engine.weights.dummy import dummy_config

    return dummy_config("qwen3.6-35b-a3b", layers=1)


class SideAware(ExpertExecutor):
    """The torch reference executor, plus `with_side_work` that runs the side work between its two
    halves (where a GPU step would wait), recording the order."""

    def __init__(self, banks: ExpertBanks) -> None:
        self.inner = TorchExpertExecutor(banks)
        self.events: list[str] = []

    def __call__(self, x, ids, weights, moe_index):  # type: ignore[no-untyped-def]
        self.events.append("plain")
        return self.inner(x, ids, weights, moe_index)

    def with_side_work(self, x, ids, weights, moe_index, side):  # type: ignore[no-untyped-def]
        self.events.append("routed")
        shared = side()
        self.events.append("side")
        return self.inner(x, ids, weights, moe_index), shared


def test_shared_expert_as_side_work_is_bit_identical() -> None:
    g = torch.Generator().manual_seed(4)
    hidden, inter, experts, k = 64, 32, 8, 2
    cfg = _cfg()
    cfg = type(cfg)(**{**cfg.__dict__, "hidden_size": hidden, "num_experts": experts, "top_k": k})
    for dtype in (torch.float32, torch.bfloat16):
        banks = ExpertBanks((torch.randn(experts, 2 * inter, hidden, generator=g) / 8).to(dtype),
                            (torch.randn(experts, hidden, inter, generator=g) / 8).to(dtype), experts)
        shared = MlpWeights(*(t.to(dtype) for t in (torch.randn(48, hidden, generator=g) / 8,
                                                    torch.randn(48, hidden, generator=g) / 8,
                                                    torch.randn(hidden, 48, generator=g) / 8)))
        w = MoeWeights(router=torch.randn(experts, hidden, generator=g).to(dtype), shared=shared,
                       shared_gate=(torch.randn(1, hidden, generator=g) / 8).to(dtype))
        x = torch.randn(3, hidden, generator=g).to(dtype)
        plain = moe_block(x, w, cfg, TorchExpertExecutor(banks), 0)
        aware = SideAware(banks)
        got = moe_block(x, w, cfg, aware, 0, captured=True)
        assert aware.events == ["routed", "side"]
        assert torch.equal(got, plain), dtype
        # the base class's side work: the plain call, then the side work; the same numbers
        assert torch.equal(moe_block(x, w, cfg, TorchExpertExecutor(banks), 0, captured=True), plain), dtype
        # without a shared expert: the plain call
        bare = SideAware(banks)
        moe_block(x, MoeWeights(router=w.router), cfg, bare, 0, captured=True)
        assert bare.events == ["plain"]
