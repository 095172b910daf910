"""Turn float32 logits into next tokens: greedy, temperature, top-k, top-p, per-request seeds.

Greedy rows are one batched argmax. Sampled rows are processed together (temperature, top-k and top-p
masks are batched), then each row draws with its own torch.Generator so that a request with a seed
gets the same text whatever else is in the batch.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from appliance.engine.request import SamplingParams


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[Optional[torch.Generator]],
           banned: Sequence[Sequence[int]] = ()) -> list[int]:
    """logits [N, V] float32; params/generators per row; banned[i] = token ids row i may not pick."""
    n = logits.shape[0]
    if n == 0:
        return []
    if banned and any(banned):
        logits = logits.clone()
        for i, ids in enumerate(banned):
            if ids:
                logits[i, list(ids)] = float("-inf")
    out = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        idx = torch.tensor(rows, device=logits.device)
        x = logits[idx]
        temp = torch.tensor([params[i].temperature for i in rows], device=x.device, dtype=x.dtype)
        x = x / temp[:, None]
        topk = [params[i].top_k if params[i].top_k > 0 else x.shape[1] for i in rows]
        if any(k < x.shape[1] for k in topk):
            k_t = torch.tensor(topk, device=x.device)
            sorted_desc = x.sort(dim=-1, descending=True).values
            kth = sorted_desc.gather(1, (k_t - 1)[:, None])
            x = x.masked_fill(x < kth, float("-inf"))
        topp = torch.tensor([params[i].top_p for i in rows], device=x.device, dtype=x.dtype)
        if bool((topp < 1.0).any()):
            probs_sorted, order = x.softmax(-1).sort(dim=-1, descending=True)
            # Drop a token when the mass before it already reaches top_p (the top token always stays).
            drop_sorted = (probs_sorted.cumsum(-1) - probs_sorted) >= topp[:, None]
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            x = x.masked_fill(drop, float("-inf"))
        probs = x.softmax(-1)
        for j, i in enumerate(rows):
            out[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
    return out.tolist()
