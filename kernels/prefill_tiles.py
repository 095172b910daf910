"""PrefillTiles: which query rows each program of the prefill attention kernel takes, built once per step.

The kernel (kernels/prefill_attention.py) runs one program per (tile, KV head). A tile is up to
`tokens_per_tile` consecutive new tokens of one prefill chunk; its G = heads / KV heads query heads
of the KV head ride as extra rows, so a program holds block_m = tokens_per_tile * G (padded) rows and
reads each K/V tile of its chunk once for all of them. Tiles are ordered longest context first, so
the longest programs start first and the short ones fill the tail. Pure Python over host lists, then
one non-blocking copy (kernels/segments.py to_device): no device sync, no per-layer work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kernels.segments import to_device

# Rows (tokens x query heads of a KV head) per program: one tensor-core M tile of 128 at head_dim
# <= 128 (docs/performance.md, prefill attention).
BLOCK_M = 128
TILE_FIELDS = 4  # per tile: q row of its first token, its tokens, position of its first token, table offset


@dataclass
class PrefillTiles:
    tiles: torch.Tensor  # [N, 4] int32: (q_row, tokens, position, table_offset) of each tile
    tables: torch.Tensor  # [sum of chunks' blocks] int32: the chunks' block tables, back to back
    num_tiles: int  # N, on the host: the kernel's grid
    num_tokens: int  # query rows [0, num_tokens) of the step the chunks cover
    group: int  # query heads per KV head the tiles were cut for
    block_m: int  # rows per program: tokens_per_tile * group, padded to a power of two
    tokens_per_tile: int


def block_m_for(group: int, block_m: int = BLOCK_M) -> int:
    """Rows per program for `group` query heads per KV head: block_m, or the group's power of two when
    larger (a tile holds at least one token)."""
    return max(block_m, 1 << max(group - 1, 0).bit_length())


def prefill_tiles(chunks: Sequence[tuple[int, int, int, Sequence[int]]], block_size: int, group: int,
                  device: torch.device, block_m: int = BLOCK_M) -> PrefillTiles:
    """Tiles of the step's prefill chunks (q_start, q_len, context_len, block table), in step order.

    Chunk j's new tokens are query rows [q_start, q_start + q_len) at positions context_len + i; it
    reads K/V positions [0, context_len + q_len) through the first ceil((context_len + q_len) /
    block_size) entries of its table. group: query heads per KV head; block_m: rows per program
    (a power of two >= 16)."""
    if group < 1 or block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"prefill_tiles: group must be >= 1 and block_m a power of two >= 16, got "
                         f"{group}, {block_m}")
    bm = block_m_for(group, block_m)
    per_tile = bm // group
    rows: list[tuple[int, int, int, int]] = []
    tables: list[int] = []
    end = 0
    for q0, n, ctx, table in chunks:
        nb = -(-(ctx + n) // block_size)
        if len(table) < nb:
            raise ValueError(f"prefill_tiles: a chunk of {n} tokens after {ctx} needs {nb} blocks, its "
                             f"table has {len(table)}")
        off = len(tables)
        tables.extend(table[:nb])
        rows.extend((q0 + i, min(per_tile, n - i), ctx + i, off) for i in range(0, n, per_tile))
        end = max(end, q0 + n)
    rows.sort(key=lambda r: -(r[1] + r[2]))  # longest K/V range first
    flat = [x for r in rows for x in r]
    tiles_t, tables_t = to_device([flat, tables], device)
    return PrefillTiles(tiles_t.view(len(rows), TILE_FIELDS), tables_t, len(rows), end, group, bm, per_tile)
