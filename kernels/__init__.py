"""Triton kernels of the appliance: one op per file, each with a checking launcher, and their
pure-torch twins in kernels/reference.py. Multi-LoRA: lora_apply.py (fused GEMV for decode, else
lora_shrink.py then lora_expand.py), lora_linear.py (prefill: the delta written first and cuBLAS
accumulating into it, or lora_gemm.py: one Triton GEMM computing h in its grid and adding the delta in
its epilogue), over the per-step segments of segments.py (backends `triton` and `csgmv`),
each kernel starting with segment_tile.py's prologue. Attention: paged_attention.py (decode),
prefill_attention.py (every prefill chunk of a step in one launch, over prefill_tiles.py's tiles). The
model's fused elementwise ops (engine.fused_kernels): rms_norm.py (residual add + RMSNorm),
rope_kv.py (RoPE + K/V cache write), silu_mul.py. platform.py says where they run; tile_config.py
reads the tuned tiles in configs/ (one JSON file per device).
Importing this package does not import triton (the `torch` backend needs none)."""
