"""Turn float32 logits into next tokens: greedy, temperature, top-k, top-p, per-request seeds.

Everything stays on the logits' device until one host transfer of the chosen tokens per step. Greedy
rows are one batched argmax. Sampled rows are processed together (temperature, top-k and top-p masks
are batched; which masks apply is decided from the host-side params, never from a device value), then
draw by the exponential race: token = argmax(p / E) with E ~ Exp(1) i.i.d. per token, which picks
token i with probability p_i. Each row's E comes from its own torch.Generator (one small launch per
seeded row, no sync), so a request with a seed gets the same text whatever else is in the batch.
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
    if not rows:
        return out.tolist()
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
    topp_list = [params[i].top_p for i in rows]
    if any(p < 1.0 for p in topp_list):
        topp = torch.tensor(topp_list, device=x.device, dtype=x.dtype)
        probs_sorted, order = x.softmax(-1).sort(dim=-1, descending=True)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        drop_sorted = (probs_sorted.cumsum(-1) - probs_sorted) >= topp[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    probs = x.softmax(-1)  # [R, V]
    noise = torch.empty_like(probs)
    unseeded = [j for j, i in enumerate(rows) if generators[i] is None]
    if unseeded:
        noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=probs.device,
                                      dtype=probs.dtype).exponential_()
    for j, i in enumerate(rows):
        g = generators[i]
        if g is not None:
            noise[j].exponential_(generator=g)
    # E > 0 almost surely; the clamp keeps a masked token (p = 0) at 0 rather than 0/0.
    picked = (probs / noise.clamp_min(1e-20)).argmax(dim=-1)
    out[idx] = picked
    return out.tolist()
