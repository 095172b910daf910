"""Triton kernels of the appliance: one op per file, each with a checking launcher, and their
pure-torch twins in kernels/reference.py. Multi-LoRA: lora_shrink.py and lora_expand.py over the
per-step segments of segments.py (backends `triton` and `csgmv`); platform.py says where they run.
Importing this package does not import triton (the `torch` backend needs none)."""
