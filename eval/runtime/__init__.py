"""The speculative runtime: what a serving engine would contain. The lean target forward with its
KV cache and tree attention, the linear-layer paths and device placement, trees, drafters,
verification, sampling and the generation loops. It imports nothing of eval's measurement (the
modules at `eval/` top level, which time and report it): imports point from measurement to
runtime only (tests/train/test_layering.py)."""
