"""Attention kernels, context-parallel strategies and the one dispatch the model calls."""
