"""Per-row token masks from the rows' grammar matchers, applied to a step's logits before sampling.

The engine keeps one xgrammar GrammarMatcher per constrained sequence; it has accepted every token the
row generated so far. Each step the matchers fill a bitmask on the host (bit t of row i = token t
allowed), which goes to the logits' device and sets the disallowed logits to -inf. Free rows get no
mask and cost nothing; a step without constrained rows never comes here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch


@dataclass
class TokenMask:
    """A step's masks: bits int32 [N, ceil(V / 32)] on the logits' device (rows not in `rows` are
    unused), rows = the constrained rows' indices; index: the same as int32 [len(rows)] on a cuda
    device (None on cpu)."""

    bits: torch.Tensor
    rows: list[int]
    vocab_size: int
    index: Optional[torch.Tensor] = None


class MaskFiller:
    """Fills the masks of a step's constrained rows into one reused host buffer (pinned on cuda).

    Reusing the buffer is safe: the engine fills only once it has read the tokens of every step
    before (async scheduling: the step before is read first), and each mask's copy is queued before
    its step's tokens, so the previous copy has completed.
    """

    def __init__(self, vocab_size: int, max_rows: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._host = self._allocate(max_rows)

    def _allocate(self, rows: int) -> torch.Tensor:
        import xgrammar as xgr

        host = xgr.allocate_token_bitmask(rows, self.vocab_size)
        return host.pin_memory() if self.device.type == "cuda" else host

    def fill(self, matchers: Sequence[Optional[Any]]) -> Optional[TokenMask]:
        """matchers[i]: row i's GrammarMatcher, None for a free row. None when no row is constrained."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        n = len(matchers)
        if n > self._host.shape[0]:  # more rows than max_num_seqs (isolated reruns never are)
            self._host = self._allocate(n)
        host = self._host[:n]
        # Row by row on this thread: xgrammar's BatchGrammarMatcher was slower at every thread count
        # measured (docs/performance.md, structured outputs), and the fill overlaps the forward.
        for i in rows:
            matchers[i].fill_next_token_bitmask(host, i)
        if self.device.type == "cpu":
            return TokenMask(host, rows, self.vocab_size)
        # The row list goes over pinned too: xgrammar's own copy of a list would wait for the forward.
        index = torch.tensor(rows, dtype=torch.int32).pin_memory().to(self.device, non_blocking=True)
        return TokenMask(host.to(self.device, non_blocking=True), rows, self.vocab_size, index)


def apply_mask(logits: torch.Tensor, mask: TokenMask) -> None:
    """logits [N, V] in place: logits[i, t] = -inf where bit t of mask.bits[i] is 0, for i in mask.rows.
    xgrammar's kernel (a CUDA kernel on the GPU, C++ on the CPU); `apply_mask_reference` is its twin."""
    import xgrammar as xgr

    rows = mask.rows if mask.index is None else mask.index
    xgr.apply_token_bitmask_inplace(logits, mask.bits, vocab_size=mask.vocab_size, indices=rows)


def apply_mask_reference(logits: torch.Tensor, mask: TokenMask) -> None:
    """Pure-torch twin of `apply_mask` (the tests' oracle)."""
    v = logits.shape[1]
    shifts = torch.arange(32, device=mask.bits.device, dtype=torch.int32)
    for i in mask.rows:
        allowed = ((mask.bits[i][:, None] >> shifts) & 1).reshape(-1)[:v].bool()
        logits[i].masked_fill_(~allowed.to(logits.device), float("-inf"))
