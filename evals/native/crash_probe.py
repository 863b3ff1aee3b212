"""Smallest native call sequence, step by step (debugging aid for a crash on another host)."""
import faulthandler
import sys

faulthandler.enable()
import torch  # noqa: E402

print("import", flush=True)
from native import ftnative as ft  # noqa: E402

print("isas", ft.supported_isas(), ft.get_isa(), flush=True)
print("cores", ft.physical_cores(), flush=True)
print("threads", ft.num_threads(), ft.num_pinned(), flush=True)
from native.formats import quantize  # noqa: E402

for isa in ft.supported_isas():
    ft.set_isa(isa)
    for fmt in ("f32", "bf16", "fp8", "mxfp4"):
        ew = quantize(torch.randn(8, 64, 128), torch.randn(8, 128, 32), fmt, (16, 32))
        ft.moe_layer(torch.randn(3, 128), torch.randint(0, 8, (3, 2)), torch.rand(3, 2), ew)
        print("ok", isa, fmt, flush=True)
print("overhead", ft.call_overhead_us(100), flush=True)
print("read", ft.read_tensor(torch.ones(1000)), flush=True)
sys.exit(0)
