"""Turn logits into next tokens: greedy, temperature, top-k, top-p, per-request seeds.

Everything stays on the logits' device until one host transfer of the chosen tokens per step. Greedy
rows are one batched argmax. Sampled rows are processed together (temperature, top-k and top-p masks
are batched; which masks apply is decided from the host-side params, never from a device value), then
draw by the exponential race: token = argmax(p / E) with E ~ Exp(1) i.i.d. per token, which picks
token i with probability p_i. Each row's E comes from its own torch.Generator (one small launch per
seeded row, no sync), so a request with a seed gets the same text whatever else is in the batch.

`sample_on_device` stops before that transfer (async scheduling reads the tokens a step later): it
never waits for the device, so every host list it needs goes over in pinned memory (a copy from
pageable memory would wait for the work queued before it, the very step being overlapped).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from appliance.engine.request import SamplingParams


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[Optional[torch.Generator]],
           banned: Sequence[Sequence[int]] = ()) -> list[int]:
    """logits [N, V] (any float dtype; the sampled rows are taken in float32); params/generators per
    row; banned[i] = token ids row i may not pick."""
    if logits.shape[0] == 0:
        return []
    return sample_on_device(logits, params, generators, banned).tolist()


def _on(device: torch.device, values: list, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A host list as a tensor on `device` without waiting for the device (pinned, non-blocking)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def sample_on_device(logits: torch.Tensor, params: Sequence[SamplingParams],
                     generators: Sequence[Optional[torch.Generator]],
                     banned: Sequence[Sequence[int]] = ()) -> torch.Tensor:
    """`sample`'s tokens as a long tensor [N] on the logits' device, queued without a host sync."""
    dev = logits.device
    if banned and any(banned):
        logits = logits.clone()
        rows_b = [i for i, ids in enumerate(banned) for _ in ids]
        cols_b = [t for ids in banned for t in ids]
        logits[_on(dev, rows_b, torch.long), _on(dev, cols_b, torch.long)] = float("-inf")
    out = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    idx = _on(dev, rows, torch.long)
    x = logits[idx].float()  # the model's dtype (LlamaModel.compute_logits): temperature and softmax in fp32
    temp = _on(dev, [params[i].temperature for i in rows], x.dtype)
    x = x / temp[:, None]
    topk = [params[i].top_k if params[i].top_k > 0 else x.shape[1] for i in rows]
    if any(k < x.shape[1] for k in topk):
        k_t = _on(dev, topk, torch.long)
        sorted_desc = x.sort(dim=-1, descending=True).values
        kth = sorted_desc.gather(1, (k_t - 1)[:, None])
        x = x.masked_fill(x < kth, float("-inf"))
    topp_list = [params[i].top_p for i in rows]
    if any(p < 1.0 for p in topp_list):
        topp = _on(dev, topp_list, x.dtype)
        probs_sorted, order = x.softmax(-1).sort(dim=-1, descending=True)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        drop_sorted = (probs_sorted.cumsum(-1) - probs_sorted) >= topp[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    probs = x.softmax(-1)  # [R, V]
    noise = torch.empty_like(probs)
    unseeded = [j for j, i in enumerate(rows) if generators[i] is None]
    if len(unseeded) == len(rows):
        noise.exponential_()
    elif unseeded:
        noise[_on(dev, unseeded, torch.long)] = torch.empty(len(unseeded), probs.shape[1], device=dev,
                                                             dtype=probs.dtype).exponential_()
    for j, i in enumerate(rows):
        g = generators[i]
        if g is not None:
            noise[j].exponential_(generator=g)
    # E > 0 almost surely; the clamp keeps a masked token (p = 0) at 0 rather than 0/0.
    picked = (probs / noise.clamp_min(1e-20)).argmax(dim=-1)
    out[idx] = picked
    return out
