"""Triton kernels of the appliance: one op per file, each with a checking launcher, and their
pure-torch twins in kernels/reference.py. The multi-LoRA ops (shrink/expand, SGMV) arrive with their
issue; until then the engine runs on plain torch."""
