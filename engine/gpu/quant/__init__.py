"""Packed (quantized) expert slots on the GPU: formats and slot sizes (formats.py), in-register
dequantisation (dequant.py), the decode GEMV over slot ids (gemv.py) and the grouped prefill GEMM
(grouped.py). The layout is the one the host banks use, so a miss copies the packed bytes as they are."""
