"""LoRASegments: which token rows each multi-LoRA kernel program works on, for both strategies.

A program handles up to BLOCK_M consecutive positions of one segment; each segment has one slot.
Position p is token row p (SGMV, `sgmv_segments`, backend `triton`: sequences in order, neighbours of
one slot merged) or row token_index[p] (`csgmv_segments`, backend `csgmv`: tokens sorted by slot and
cut into chunks, so many sequences on few adapters read each adapter once per chunk). Base tokens
have no segment and cost nothing; `base_rows` lists them for lora_expand's write mode. Built on the
host with one non-blocking copy; `sorted_segments_device` builds csgmv's layout on the device in
shapes fixed by the row count, for CUDA-graph decode, giving base rows slot -1 chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass
class LoRASegments:
    starts: torch.Tensor  # [G] int32: first position of each segment
    lens: torch.Tensor  # [G] int32: positions in each segment (>= 1; 0 only in sorted_segments_device's tail)
    slots: torch.Tensor  # [G] int32: slot of each segment (base tokens have no segment; -1 only in the
    # static decode batch of engine/cuda_graph.py: one segment per row, or sorted_segments_device's
    # chunks, base and padding rows at -1)
    token_index: Optional[torch.Tensor]  # [P] int32: token row at each position; None = row = position
    max_len: int  # longest segment, kept on the host: it sizes the grid without a device sync
    # [Tb] int32: rows of the base tokens, for lora_expand's write mode (it zeroes them); None = not built
    base_rows: Optional[torch.Tensor] = None
    num_rows: int = 0  # adapter tokens (positions) in all segments, on the host
    # [T] int32: slot of each token row, -1 = base; for kernels that walk rows, not segments
    # (kernels/lora_gemm.py's epilogue). None = not built (the static decode batch).
    row_slots: Optional[torch.Tensor] = None
    # sorted_segments_device's layout (the static decode batch, slot-sorted): every row is in exactly
    # one segment, base and padding rows in slot -1 chunks; base_rows None (nothing listed)
    static_sorted: bool = False

    @property
    def num_segs(self) -> int:
        return self.starts.shape[0]


def rows_covered(segs: LoRASegments) -> int:
    """Rows of the step the segments and the listed base rows account for (each once); with base_rows
    None (the static decode batch of engine/cuda_graph.py) one segment per row, or every row of
    sorted_segments_device's layout (its token_index); -1 (never a row count) when unknown."""
    if segs.base_rows is None:
        if segs.static_sorted:
            return segs.token_index.shape[0]
        return segs.num_segs if segs.token_index is None else -1
    return segs.num_rows + segs.base_rows.shape[0]


def sgmv_segments(seg_lens: Sequence[int], seg_slots: Sequence[int], device: torch.device) -> LoRASegments:
    """Sequences (lengths, slot or -1) in token order -> segments over token rows."""
    starts: list[int] = []
    lens: list[int] = []
    slots: list[int] = []
    base: list[int] = []
    row_slots: list[int] = []
    row = 0
    for n, s in zip(seg_lens, seg_slots):
        row_slots.extend([max(s, -1)] * n)
        if s < 0:
            base.extend(range(row, row + n))
        elif n > 0:
            if slots and slots[-1] == s and starts[-1] + lens[-1] == row:
                lens[-1] += n  # same adapter right after: one segment, A/B read once
            else:
                starts.append(row)
                lens.append(n)
                slots.append(s)
        row += n
    starts_t, lens_t, slots_t, base_t, rs_t = to_device([starts, lens, slots, base, row_slots], device)
    return LoRASegments(starts_t, lens_t, slots_t, None, max(lens, default=0), base_t, sum(lens), rs_t)


def csgmv_segments(seg_lens: Sequence[int], seg_slots: Sequence[int], max_chunk_size: int,
                   device: torch.device) -> LoRASegments:
    """Sequences (lengths, slot or -1) in token order -> adapter tokens sorted by slot, in chunks of at
    most `max_chunk_size` positions of one slot."""
    if max_chunk_size < 1:
        raise ValueError(f"max_chunk_size must be >= 1, got {max_chunk_size}")
    rows_by_slot: dict[int, list[int]] = {}
    base: list[int] = []
    row_slots: list[int] = []
    row = 0
    for n, s in zip(seg_lens, seg_slots):
        row_slots.extend([max(s, -1)] * n)
        if s >= 0:
            rows_by_slot.setdefault(s, []).extend(range(row, row + n))
        else:
            base.extend(range(row, row + n))
        row += n
    token_index: list[int] = []
    starts: list[int] = []
    lens: list[int] = []
    slots: list[int] = []
    for s in sorted(rows_by_slot):
        rows = rows_by_slot[s]
        for c in range(0, len(rows), max_chunk_size):
            starts.append(len(token_index) + c)
            lens.append(min(max_chunk_size, len(rows) - c))
            slots.append(s)
        token_index.extend(rows)
    starts_t, lens_t, slots_t, index_t, base_t, rs_t = to_device(
        [starts, lens, slots, token_index, base, row_slots], device)
    return LoRASegments(starts_t, lens_t, slots_t, index_t, max(lens, default=0), base_t, len(token_index), rs_t)


def sorted_segments_device(row_slots: torch.Tensor, num_slots: int, chunk: int) -> LoRASegments:
    """csgmv_segments' layout built on the device from the rows' slots, with shapes that depend only on
    the row count: what a CUDA graph can replay for any step of that size (engine/cuda_graph.py).

    row_slots [b] int32 (-1 = base or padding row). Rows are stably sorted by slot (base rows last, as
    slot -1 chunks the LoRA kernels skip), so every row is in one segment. The grid is fixed at
    cdiv(b, chunk) + min(num_slots + 1, b) segments; the unused tail has length 0. max_len = chunk."""
    b = row_slots.shape[0]
    dev = row_slots.device
    key = torch.where(row_slots < 0, num_slots, row_slots).long()  # base rows: key num_slots, sorted last
    token_index = torch.sort(key, stable=True).indices.to(torch.int32)
    counts = torch.zeros(num_slots + 1, dtype=torch.long, device=dev).scatter_add_(0, key, torch.ones_like(key))
    first_row = torch.cumsum(counts, 0) - counts  # position of each key's first row in token_index
    nchunks = (counts + chunk - 1) // chunk
    chunk_end = torch.cumsum(nchunks, 0)  # one past each key's last segment
    G = -(-b // chunk) + min(num_slots + 1, b)
    g = torch.arange(G, device=dev)
    key_of = torch.searchsorted(chunk_end, g, right=True)  # the key whose segments hold segment g
    live = key_of <= num_slots
    k = key_of.clamp(max=num_slots)
    c = g - (chunk_end[k] - nchunks[k])  # chunk number within its key
    starts = torch.where(live, first_row[k] + c * chunk, 0).to(torch.int32)
    lens = torch.where(live, (counts[k] - c * chunk).clamp(0, chunk), 0).to(torch.int32)
    slots = torch.where(key_of < num_slots, k, -1).to(torch.int32)
    return LoRASegments(starts, lens, slots, token_index, chunk, static_sorted=True)


# Views start 16-byte aligned: Triton specializes pointers on it, so packed views would compile mid-request.
_ALIGN = 4  # int32 elements


def to_device(parts: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """One int32 host buffer, one copy, then views: a single small transfer per step. Each view starts
    at a multiple of 16 bytes (the gaps are padding, never read)."""
    flat: list[int] = []
    starts = []
    for p in parts:
        starts.append(len(flat))
        flat.extend(p)
        flat.extend([0] * (-len(flat) % _ALIGN))
    buf = torch.tensor(flat, dtype=torch.int32)
    if device.type == "cuda":
        # From pinned memory the copy is queued on the stream and the host goes on at once.
        buf = buf.pin_memory().to(device, non_blocking=True)
    elif buf.device != device:
        buf = buf.to(device)
    return [buf[o:o + len(p)] for o, p in zip(starts, parts)]


def check_segments(segs: LoRASegments, slot_ranks: torch.Tensor, num_slots: int, device: torch.device) -> None:
    """The launchers' check of the metadata they are given (dtype, device, shape)."""
    tensors = [segs.starts, segs.lens, segs.slots, slot_ranks]
    tensors += [t for t in (segs.token_index, segs.base_rows) if t is not None]
    for t in tensors:
        if t.dtype != torch.int32 or t.device != device or t.dim() != 1:
            raise ValueError(f"LoRA kernel metadata must be 1-D int32 on {device}, got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")
    if slot_ranks.shape[0] != num_slots:
        raise ValueError(f"slot_ranks has {slot_ranks.shape[0]} slots, the weights have {num_slots}")


def check_tile(**sizes: int) -> None:
    """Tile sizes must be powers of two >= 16 (tl.dot's smallest tile)."""
    for name, v in sizes.items():
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {v}")
