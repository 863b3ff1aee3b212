"""The GPU expert tier: a slot pool of resident experts shared by all MoE layers, its device-side
table and LRU state, the per-layer plan that splits misses between PCIe fetches and the CPU
executor (q*), the executor that runs both halves and merges them, and the streamed prefill that
runs dense chunks entirely from the pool (prefill.py).

Everything here is plain torch on a given device, so CPU-only CI runs the same code with the CPU
standing in for the GPU (see engine/gpu/executor.py).
"""
