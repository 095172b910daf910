"""kernels/tile_config.py: the device files reproduce the tiles the code chose before they were data, and a
bad file fails naming the file and the key."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import tile_config
from kernels.tile_config import CONFIG_DIR, ApplyTiles, GemmLaunch, GemmTiles, for_device, load

# (device type, K, out_offsets, max rank) -> (block_m, block_n, block_k, num_warps, num_stages, group_m,
# persistent, block_ks, shrink_stages) as lora_gemm resolved them at 349cbea, when they were constants in
# kernels/lora_gemm.py (DEFAULT_TILES on every CUDA device, _CPU_TILES under the interpreter, group_m_for,
# PERSISTENT_MIN_OUT). Shapes: Llama-3.1-8B's projections at tp 1, 2, 4, 8, SmolLM2-135M's, and odd slices.
BEFORE = [
    ('cuda', 4096, [0, 4096, 5120, 6144], 8, (128, 256, 64, 8, 3, 16, False, 128, 4)),
    ('cuda', 4096, [0, 4096, 5120, 6144], 16, (128, 256, 64, 8, 3, 16, False, 128, 3)),
    ('cuda', 4096, [0, 4096, 5120, 6144], 64, (128, 256, 64, 8, 3, 16, False, 128, 3)),
    ('cuda', 4096, [0, 4096], 8, (128, 256, 64, 8, 3, 8, False, 128, 4)),
    ('cuda', 4096, [0, 4096], 16, (128, 256, 64, 8, 3, 8, False, 128, 4)),
    ('cuda', 4096, [0, 4096], 64, (128, 256, 64, 8, 3, 8, False, 128, 3)),
    ('cuda', 4096, [0, 14336, 28672], 8, (128, 256, 64, 8, 3, 8, True, 128, 4)),
    ('cuda', 4096, [0, 14336, 28672], 16, (128, 256, 64, 8, 3, 8, True, 128, 4)),
    ('cuda', 4096, [0, 14336, 28672], 64, (128, 256, 64, 8, 3, 8, True, 128, 3)),
    ('cuda', 14336, [0, 4096], 8, (128, 256, 64, 8, 3, 8, False, 128, 4)),
    ('cuda', 14336, [0, 4096], 16, (128, 256, 64, 8, 3, 8, False, 128, 4)),
    ('cuda', 14336, [0, 4096], 64, (128, 256, 64, 8, 3, 8, False, 128, 3)),
    ('cuda', 4096, [0, 2048, 2560, 3072], 8, (128, 256, 64, 8, 3, 8, False, 128, 4)),
    ('cuda', 4096, [0, 2048, 2560, 3072], 16, (128, 256, 64, 8, 3, 8, False, 128, 3)),
    ('cuda', 4096, [0, 2048, 2560, 3072], 64, (128, 256, 64, 8, 3, 8, False, 128, 3)),
    ('cuda', 2048, [0, 4096], 8, (128, 256, 64, 8, 3, 8, False, 128, 4)),
    ('cuda', 2048, [0, 4096], 16, (128, 256, 64, 8, 3, 8, False, 128, 4)),
    ('cuda', 2048, [0, 4096], 64, (128, 256, 64, 8, 3, 8, False, 128, 3)),
    ('cuda', 4096, [0, 7168, 14336], 8, (128, 256, 64, 8, 3, 16, False, 128, 4)),
    ('cuda', 4096, [0, 7168, 14336], 16, (128, 256, 64, 8, 3, 16, False, 128, 4)),
    ('cuda', 4096, [0, 7168, 14336], 64, (128, 256, 64, 8, 3, 16, False, 128, 3)),
    ('cuda', 7168, [0, 4096], 8, (128, 256, 64, 8, 3, 8, False, 128, 4)),
    ('cuda', 7168, [0, 4096], 16, (128, 256, 64, 8, 3, 8, False, 128, 4)),
    ('cuda', 7168, [0, 4096], 64, (128, 256, 64, 8, 3, 8, False, 128, 3)),
    ('cuda', 4096, [0, 1024, 1280, 1536], 8, (128, 256, 64, 8, 3, 8, False, 128, 4)),
    ('cuda', 4096, [0, 1024, 1280, 1536], 16, (128, 256, 64, 8, 3, 8, False, 128, 3)),
    ('cuda', 4096, [0, 1024, 1280, 1536], 64, (128, 256, 64, 8, 3, 8, False, 128, 3)),
    ('cuda', 1024, [0, 4096], 8, (128, 256, 64, 8, 3, 8, False, 128, 4)),
    ('cuda', 1024, [0, 4096], 16, (128, 256, 64, 8, 3, 8, False, 128, 4)),
    ('cuda', 1024, [0, 4096], 64, (128, 256, 64, 8, 3, 8, False, 128, 3)),
    ('cuda', 4096, [0, 3584, 7168], 8, (128, 256, 64, 8, 3, 16, False, 128, 4)),
    ('cuda', 4096, [0, 3584, 7168], 16, (128, 256, 64, 8, 3, 16, False, 128, 4)),
    ('cuda', 4096, [0, 3584, 7168], 64, (128, 256, 64, 8, 3, 16, False, 128, 3)),
    ('cuda', 3584, [0, 4096], 8, (128, 256, 64, 8, 3, 8, False, 128, 4)),
    ('cuda', 3584, [0, 4096], 16, (128, 256, 64, 8, 3, 8, False, 128, 4)),
    ('cuda', 3584, [0, 4096], 64, (128, 256, 64, 8, 3, 8, False, 128, 3)),
    ('cuda', 4096, [0, 512, 640, 768], 8, (128, 128, 64, 8, 3, 8, False, 128, 4)),
    ('cuda', 4096, [0, 512, 640, 768], 16, (128, 128, 64, 8, 3, 8, False, 128, 3)),
    ('cuda', 4096, [0, 512, 640, 768], 64, (128, 128, 64, 8, 3, 8, False, 128, 3)),
    ('cuda', 512, [0, 4096], 8, (128, 256, 64, 8, 3, 8, False, 128, 4)),
    ('cuda', 512, [0, 4096], 16, (128, 256, 64, 8, 3, 8, False, 128, 4)),
    ('cuda', 512, [0, 4096], 64, (128, 256, 64, 8, 3, 8, False, 128, 3)),
    ('cuda', 4096, [0, 1792, 3584], 8, (128, 256, 64, 8, 3, 8, False, 128, 4)),
    ('cuda', 4096, [0, 1792, 3584], 16, (128, 256, 64, 8, 3, 8, False, 128, 4)),
    ('cuda', 4096, [0, 1792, 3584], 64, (128, 256, 64, 8, 3, 8, False, 128, 3)),
    ('cuda', 1792, [0, 4096], 8, (128, 256, 64, 8, 3, 8, False, 128, 4)),
    ('cuda', 1792, [0, 4096], 16, (128, 256, 64, 8, 3, 8, False, 128, 4)),
    ('cuda', 1792, [0, 4096], 64, (128, 256, 64, 8, 3, 8, False, 128, 3)),
    ('cuda', 576, [0, 576, 768, 960], 8, (128, 64, 64, 8, 3, 8, False, 128, 4)),
    ('cuda', 576, [0, 576, 768, 960], 16, (128, 64, 64, 8, 3, 8, False, 128, 3)),
    ('cuda', 576, [0, 576, 768, 960], 64, (128, 64, 64, 8, 3, 8, False, 128, 3)),
    ('cuda', 576, [0, 576], 8, (128, 256, 64, 8, 3, 8, False, 128, 4)),
    ('cuda', 576, [0, 576], 16, (128, 256, 64, 8, 3, 8, False, 128, 4)),
    ('cuda', 576, [0, 576], 64, (128, 256, 64, 8, 3, 8, False, 128, 3)),
    ('cuda', 576, [0, 1536, 3072], 8, (128, 256, 64, 8, 3, 8, False, 128, 4)),
    ('cuda', 576, [0, 1536, 3072], 16, (128, 256, 64, 8, 3, 8, False, 128, 4)),
    ('cuda', 576, [0, 1536, 3072], 64, (128, 256, 64, 8, 3, 8, False, 128, 3)),
    ('cuda', 1536, [0, 576], 8, (128, 256, 64, 8, 3, 8, False, 128, 4)),
    ('cuda', 1536, [0, 576], 16, (128, 256, 64, 8, 3, 8, False, 128, 4)),
    ('cuda', 1536, [0, 576], 64, (128, 256, 64, 8, 3, 8, False, 128, 3)),
    ('cuda', 4096, [0, 8192], 8, (128, 256, 64, 8, 3, 16, False, 128, 4)),
    ('cuda', 4096, [0, 8192], 16, (128, 256, 64, 8, 3, 16, False, 128, 4)),
    ('cuda', 4096, [0, 8192], 64, (128, 256, 64, 8, 3, 16, False, 128, 3)),
    ('cuda', 4096, [0, 20000], 8, (128, 256, 64, 8, 3, 8, True, 128, 4)),
    ('cuda', 4096, [0, 20000], 16, (128, 256, 64, 8, 3, 8, True, 128, 4)),
    ('cuda', 4096, [0, 20000], 64, (128, 256, 64, 8, 3, 8, True, 128, 3)),
    ('cuda', 2048, [0, 16384], 8, (128, 256, 64, 8, 3, 16, False, 128, 4)),
    ('cuda', 2048, [0, 16384], 16, (128, 256, 64, 8, 3, 16, False, 128, 4)),
    ('cuda', 2048, [0, 16384], 64, (128, 256, 64, 8, 3, 16, False, 128, 3)),
    ('cuda', 2048, [0, 16400], 8, (128, 256, 64, 8, 3, 8, True, 128, 4)),
    ('cuda', 2048, [0, 16400], 16, (128, 256, 64, 8, 3, 8, True, 128, 4)),
    ('cuda', 2048, [0, 16400], 64, (128, 256, 64, 8, 3, 8, True, 128, 3)),
    ('cuda', 8192, [0, 6000, 12000], 8, (128, 16, 64, 8, 3, 16, False, 128, 4)),
    ('cuda', 8192, [0, 6000, 12000], 16, (128, 16, 64, 8, 3, 16, False, 128, 4)),
    ('cuda', 8192, [0, 6000, 12000], 64, (128, 16, 64, 8, 3, 16, False, 128, 3)),
    ('cuda', 40, [0, 32, 48, 64], 8, (128, 16, 64, 8, 3, 8, False, 128, 4)),
    ('cuda', 40, [0, 32, 48, 64], 16, (128, 16, 64, 8, 3, 8, False, 128, 3)),
    ('cuda', 40, [0, 32, 48, 64], 64, (128, 16, 64, 8, 3, 8, False, 128, 3)),
    ('cuda', 5120, [0, 5120, 6144, 7168], 8, (128, 256, 64, 8, 3, 16, False, 128, 4)),
    ('cuda', 5120, [0, 5120, 6144, 7168], 16, (128, 256, 64, 8, 3, 16, False, 128, 3)),
    ('cuda', 5120, [0, 5120, 6144, 7168], 64, (128, 256, 64, 8, 3, 16, False, 128, 3)),
    ('cuda', 4096, [0, 4000, 4096], 8, (128, 32, 64, 8, 3, 16, False, 128, 4)),
    ('cuda', 4096, [0, 4000, 4096], 16, (128, 32, 64, 8, 3, 16, False, 128, 4)),
    ('cuda', 4096, [0, 4000, 4096], 64, (128, 32, 64, 8, 3, 16, False, 128, 3)),
    ('cuda', 4096, [0, 6000, 6144], 8, (128, 16, 64, 8, 3, 16, False, 128, 4)),
    ('cuda', 4096, [0, 6000, 6144], 16, (128, 16, 64, 8, 3, 16, False, 128, 4)),
    ('cuda', 4096, [0, 6000, 6144], 64, (128, 16, 64, 8, 3, 16, False, 128, 3)),
    ('cuda', 4096, [0, 14000, 28672], 8, (128, 16, 64, 8, 3, 8, True, 128, 4)),
    ('cuda', 4096, [0, 14000, 28672], 16, (128, 16, 64, 8, 3, 8, True, 128, 4)),
    ('cuda', 4096, [0, 14000, 28672], 64, (128, 16, 64, 8, 3, 8, True, 128, 3)),
    ('cuda', 4096, [0, 4080, 5120, 6144], 8, (128, 16, 64, 8, 3, 16, False, 128, 4)),
    ('cuda', 4096, [0, 4080, 5120, 6144], 16, (128, 16, 64, 8, 3, 16, False, 128, 3)),
    ('cuda', 4096, [0, 4080, 5120, 6144], 64, (128, 16, 64, 8, 3, 16, False, 128, 3)),
    ('cpu', 4096, [0, 4096, 5120, 6144], 8, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 4096, 5120, 6144], 16, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 4096, 5120, 6144], 64, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 4096], 8, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 4096], 16, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 4096], 64, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 14336, 28672], 8, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 14336, 28672], 16, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 14336, 28672], 64, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 14336, [0, 4096], 8, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 14336, [0, 4096], 16, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 14336, [0, 4096], 64, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 2048, 2560, 3072], 8, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 2048, 2560, 3072], 16, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 2048, 2560, 3072], 64, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 2048, [0, 4096], 8, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 2048, [0, 4096], 16, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 2048, [0, 4096], 64, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 7168, 14336], 8, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 7168, 14336], 16, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 7168, 14336], 64, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 7168, [0, 4096], 8, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 7168, [0, 4096], 16, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 7168, [0, 4096], 64, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 1024, 1280, 1536], 8, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 1024, 1280, 1536], 16, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 1024, 1280, 1536], 64, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 1024, [0, 4096], 8, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 1024, [0, 4096], 16, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 1024, [0, 4096], 64, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 3584, 7168], 8, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 3584, 7168], 16, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 3584, 7168], 64, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 3584, [0, 4096], 8, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 3584, [0, 4096], 16, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 3584, [0, 4096], 64, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 512, 640, 768], 8, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 512, 640, 768], 16, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 512, 640, 768], 64, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 512, [0, 4096], 8, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 512, [0, 4096], 16, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 512, [0, 4096], 64, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 1792, 3584], 8, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 1792, 3584], 16, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 1792, 3584], 64, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 1792, [0, 4096], 8, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 1792, [0, 4096], 16, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 1792, [0, 4096], 64, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 576, [0, 576, 768, 960], 8, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 576, [0, 576, 768, 960], 16, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 576, [0, 576, 768, 960], 64, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 576, [0, 576], 8, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 576, [0, 576], 16, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 576, [0, 576], 64, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 576, [0, 1536, 3072], 8, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 576, [0, 1536, 3072], 16, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 576, [0, 1536, 3072], 64, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 1536, [0, 576], 8, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 1536, [0, 576], 16, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 1536, [0, 576], 64, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 8192], 8, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 8192], 16, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 8192], 64, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 20000], 8, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 20000], 16, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 20000], 64, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 2048, [0, 16384], 8, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 2048, [0, 16384], 16, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 2048, [0, 16384], 64, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 2048, [0, 16400], 8, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 2048, [0, 16400], 16, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 2048, [0, 16400], 64, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 8192, [0, 6000, 12000], 8, (32, 16, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 8192, [0, 6000, 12000], 16, (32, 16, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 8192, [0, 6000, 12000], 64, (32, 16, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 40, [0, 32, 48, 64], 8, (32, 16, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 40, [0, 32, 48, 64], 16, (32, 16, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 40, [0, 32, 48, 64], 64, (32, 16, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 5120, [0, 5120, 6144, 7168], 8, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 5120, [0, 5120, 6144, 7168], 16, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 5120, [0, 5120, 6144, 7168], 64, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 4000, 4096], 8, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 4000, 4096], 16, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 4000, 4096], 64, (32, 32, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 6000, 6144], 8, (32, 16, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 6000, 6144], 16, (32, 16, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 6000, 6144], 64, (32, 16, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 14000, 28672], 8, (32, 16, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 14000, 28672], 16, (32, 16, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 14000, 28672], 64, (32, 16, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 4080, 5120, 6144], 8, (32, 16, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 4080, 5120, 6144], 16, (32, 16, 32, 4, 1, 2, False, 32, 1)),
    ('cpu', 4096, [0, 4080, 5120, 6144], 64, (32, 16, 32, 4, 1, 2, False, 32, 1)),
]


def _launch(tiles, K: int, offs: list, R: int) -> tuple:
    launch = tiles.gemm_launch(tiles.gemm(offs[-1], K), offs, R)
    return tuple(getattr(launch, f) for f in GemmLaunch.__dataclass_fields__)


@pytest.mark.parametrize("name", ["NVIDIA H200", "NVIDIA H100 80GB HBM3", "some other GPU"])
def test_every_cuda_file_reproduces_the_tiles_chosen_before(name: str) -> None:
    tiles = for_device(name)
    assert tiles.path.name == ("NVIDIA_H200.json" if name == "NVIDIA H200" else "default.json")
    rows = [(K, offs, R, want) for dev, K, offs, R, want in BEFORE if dev == "cuda"]
    assert len(rows) > 50
    for K, offs, R, want in rows:
        assert _launch(tiles, K, offs, R) == want, (name, K, offs, R)


def test_the_interpreter_file_reproduces_the_cpu_tiles() -> None:
    tiles = for_device("cpu")
    assert tiles.path.name == "cpu.json"
    for dev, K, offs, R, want in BEFORE:
        if dev == "cpu":
            assert _launch(tiles, K, offs, R) == want, (K, offs, R)


def test_h200_keys_its_tuned_shapes_and_lora_apply_keeps_its_tma_tiles() -> None:
    h200 = for_device("NVIDIA H200")
    assert h200.gemm(6144, 4096).group_m == 16 and h200.gemm(28672, 4096).persistent is True
    assert h200.gemm(4096, 4096) == h200.gemm_default
    for name in ("NVIDIA H200", "another GPU", "cpu"):
        assert for_device(name).apply_tma == ApplyTiles(block_k=256, block_n=256, num_stages=4, num_warps=4)


def test_device_names_become_file_names() -> None:
    assert tile_config.file_stem("NVIDIA H200") == "NVIDIA_H200"
    assert tile_config.file_stem(" NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3"
    assert tile_config.file_stem("AMD Instinct MI300X/OAM") == "AMD_Instinct_MI300X_OAM"


def _write(tmp_path: Path, edit) -> Path:
    raw = json.loads((CONFIG_DIR / "NVIDIA_H200.json").read_text())
    edit(raw)
    path = tmp_path / "NVIDIA_TEST.json"
    path.write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize("edit, where", [
    (lambda r: r["lora_gemm"]["default"].update(block_m=0), "lora_gemm.default.block_m: expected a positive integer"),
    (lambda r: r["lora_gemm"]["default"].update(block_m="128"), "lora_gemm.default.block_m"),
    (lambda r: r["lora_gemm"]["default"].pop("num_warps"), "lora_gemm.default: missing key(s) ['num_warps']"),
    (lambda r: r["lora_gemm"]["shapes"].update({"N=6144,K=4096": {"persistant": True}}),
     "lora_gemm.shapes.N=6144,K=4096: unknown key(s) ['persistant']"),
    (lambda r: r["lora_gemm"]["shapes"].update({"N=6144,K=4096": {"persistent": 1}}),
     "lora_gemm.shapes.N=6144,K=4096.persistent: expected true, false or null"),
    (lambda r: r["lora_gemm"]["shapes"].update({"6144x4096": {}}), "lora_gemm.shapes.6144x4096: a shape key"),
    (lambda r: r["lora_gemm"]["rules"].update(group_m=None), "lora_gemm.rules.group_m: expected a positive integer,"),
    (lambda r: r.pop("lora_apply_tma"), "<top>: missing key(s) ['lora_apply_tma']"),
    (lambda r: r.update(lora_shrink={}), "<top>: unknown key(s) ['lora_shrink']"),
])
def test_a_bad_file_names_the_file_and_the_key(tmp_path: Path, edit, where: str) -> None:
    path = _write(tmp_path, edit)
    with pytest.raises(ValueError) as e:
        load(path)
    assert str(e.value).startswith(f"{path}: {where}")


def test_a_shape_entry_overrides_the_default_for_that_shape_only(tmp_path: Path) -> None:
    path = _write(tmp_path, lambda r: r["lora_gemm"]["shapes"].update({"N=4096,K=14336": {"block_m": 64}}))
    tiles = for_device("NVIDIA TEST", tmp_path)
    assert tiles.path == path
    assert tiles.gemm(4096, 14336) == GemmTiles(64, 256, 64, num_warps=8, num_stages=3, block_ks=128)
    assert tiles.gemm(4096, 4096) == tiles.gemm_default


def test_unreadable_json_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=f"^{path}: cannot read tile config"):
        load(path)


def test_the_loader_imports_no_torch() -> None:
    code = "import sys, kernels.tile_config as t; t.for_device('NVIDIA H200'); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "False"


def test_the_device_files_ship_in_the_package() -> None:
    toml = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert '"kernels" = ["configs/*.json"]' in toml
    assert {p.name for p in CONFIG_DIR.glob("*.json")} >= {"default.json", "cpu.json", "NVIDIA_H200.json"}
