"""The paged KV cache's allocator: fixed-size blocks, per-sequence block tables, ref counts.

Pure Python: the model runner owns the tensors, this class only hands out block indices. Ref counts
let several sequences share a block: the parallel samples of one prompt (`n`) share its full blocks
(`share`); a block is free again when its last owner frees it.
"""

from __future__ import annotations

from collections import deque

from appliance.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks `seq` needs so that its first `num_tokens` tokens have cache slots."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {need}, have {len(self._free)}")
        for _ in range(need):
            b = self._free.popleft()
            self._refs[b] = 1
            seq.block_table.append(b)

    def share(self, seq: Sequence, source: Sequence, num_blocks: int) -> None:
        """Give `seq` (holding no blocks) the first `num_blocks` blocks of `source`: full blocks, read only."""
        if seq.block_table or num_blocks > len(source.block_table):
            raise RuntimeError(f"cannot share {num_blocks} blocks of {source.request_id} with {seq.request_id}")
        seq.block_table = source.block_table[:num_blocks]
        for b in seq.block_table:
            self._refs[b] += 1

    def free(self, seq: Sequence) -> None:
        # Release in reverse so the most recently used blocks are reused last (no semantic effect).
        for b in reversed(seq.block_table):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)
            elif self._refs[b] < 0:
                raise RuntimeError(f"block {b} freed twice")
        seq.block_table = []
