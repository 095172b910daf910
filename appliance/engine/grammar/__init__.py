"""Structured outputs: a request's grammar (spec.py), compiled by xgrammar (compiler.py) and applied as a
per-row token mask beside the sampler (mask.py)."""
