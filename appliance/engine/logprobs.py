"""Logprobs of the generated tokens: computed on the device for the whole step, read in one transfer.

They are vLLM's default "raw" logprobs: log_softmax of the model's float32 logits before logit bias,
penalties, temperature and the top-k/top-p/min-p filters, so they describe the model, not the filtered
distribution a token was drawn from (docs/sampling.md). The chosen token, its logprob and the k best
(k = the largest `logprobs` of the step's rows) are packed into one float64 matrix, whose every value
(token ids below 2^53, float32 logprobs) is exact, so the step's tokens and logprobs cross to the host
together.
"""

from __future__ import annotations

from typing import Optional, Sequence as Seq

import torch

from appliance.engine.request import SamplingParams, TokenLogprob


def pack(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """logits [N, V], tokens long [N] -> float64 [N, 2 + 2k]: token, its logprob, k ids, k logprobs."""
    lp = logits.float().log_softmax(-1)
    cols = [tokens[:, None].double(), lp.gather(1, tokens[:, None]).double()]
    if k > 0:
        top = lp.topk(k, dim=-1)
        cols += [top.indices.double(), top.values.double()]
    return torch.cat(cols, dim=1)


def wanted(params: Seq[SamplingParams]) -> Optional[int]:
    """The number of top logprobs to compute for the step; None when no row asked for logprobs."""
    ks = [p.logprobs for p in params if p.logprobs is not None]
    return max(ks) if ks else None


def unpack(host: list[list[float]], params: Seq[SamplingParams]) -> list[Optional[TokenLogprob]]:
    """pack's rows (as host lists) -> each row's TokenLogprob, None for rows that did not ask."""
    out: list[Optional[TokenLogprob]] = []
    for row, p in zip(host, params):
        if p.logprobs is None:
            out.append(None)
            continue
        k = (len(row) - 2) // 2
        top = [(int(row[2 + j]), row[2 + k + j]) for j in range(p.logprobs)]
        out.append(TokenLogprob(int(row[0]), row[1], top))
    return out
