"""maxctx: config-driven LLM pretraining in JAX, built for long context.

The module map, layer by layer, is the README's "Layout" section; tests/test_layering.py holds the same layers and
fails on an upward import or a cycle.
"""
