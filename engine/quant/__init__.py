"""Packed (quantized) weight formats: the registry, reference dequantisers and load-time conversions."""
