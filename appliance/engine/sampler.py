"""Turn logits into next tokens: bias, penalties, grammar masks, greedy, temperature, min-p, top-k,
top-p, seeds.

Everything stays on the logits' device until one host transfer of the chosen tokens (and, when a row
asked, their logprobs: engine/logprobs.py) per step. The order is vLLM's: logprobs of the raw logits;
then, in float32, logit bias, the min_tokens ban, the penalties (engine/penalties.py), the constrained
rows' grammar masks (engine/grammar/mask.py: last, so no bias brings back a token); greedy rows are
one batched argmax of that. Sampled rows are processed together (temperature, top-k and top-p masks
are batched, min-p too; which masks apply is decided from the host-side params, never from a device value), then
draw by the exponential race: token = argmax(p / E) with E ~ Exp(1) i.i.d. per token, which picks
token i with probability p_i. Each row's E comes from its own torch.Generator (one small launch per
seeded row, no sync), so a request with a seed gets the same text whatever else is in the batch.

`sample_on_device` stops before that transfer (async scheduling reads the tokens a step later): it
never waits for the device, so every host list it needs goes over in pinned memory (a copy from
pageable memory would wait for the work queued before it, the very step being overlapped).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from appliance.engine import logprobs as lp
from appliance.engine.grammar.mask import TokenMask, apply_mask
from appliance.engine.penalties import apply_logit_bias, apply_penalties
from appliance.engine.request import SamplingParams, TokenLogprob


@dataclass
class DeviceSample:
    """A step's draw, still on the device: tokens long [N]; `packed` float64 [N, 2 + 2k] (logprobs.pack)
    when some row asked for logprobs, else None."""

    tokens: torch.Tensor
    packed: Optional[torch.Tensor]

    def for_host(self) -> torch.Tensor:
        """The one tensor to move to the host: `packed` when there is one (it holds the tokens)."""
        return self.tokens if self.packed is None else self.packed

    @staticmethod
    def read(host: torch.Tensor, params: Sequence[SamplingParams]
             ) -> tuple[list[int], Optional[list[Optional[TokenLogprob]]]]:
        """for_host()'s tensor on the host -> (tokens, per-row logprobs or None)."""
        if host.dtype == torch.long:
            return host.tolist(), None
        rows = host.tolist()
        return [int(r[0]) for r in rows], lp.unpack(rows, params)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[Optional[torch.Generator]],
           banned: Sequence[Sequence[int]] = (),
           history: Sequence[tuple[Sequence[int], Sequence[int]]] = (),
           mask: Optional[TokenMask] = None) -> list[int]:
    """logits [N, V] (any float dtype; processed in float32); params/generators per row; banned[i] =
    token ids row i may not pick; history[i] = (prompt ids, generated ids), read for penalised rows;
    mask: the constrained rows' allowed tokens."""
    return sample_full(logits, params, generators, banned, history, mask)[0]


def sample_full(logits: torch.Tensor, params: Sequence[SamplingParams],
                generators: Sequence[Optional[torch.Generator]],
                banned: Sequence[Sequence[int]] = (),
                history: Sequence[tuple[Sequence[int], Sequence[int]]] = (),
                mask: Optional[TokenMask] = None
                ) -> tuple[list[int], Optional[list[Optional[TokenLogprob]]]]:
    """`sample` plus each row's logprobs (None when no row asked); one host transfer."""
    if logits.shape[0] == 0:
        return [], None
    d = sample_on_device(logits, params, generators, banned, history, mask)
    return DeviceSample.read(d.for_host().cpu(), params)


def _on(device: torch.device, values: list, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A host list as a tensor on `device` without waiting for the device (pinned, non-blocking)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def sample_on_device(logits: torch.Tensor, params: Sequence[SamplingParams],
                     generators: Sequence[Optional[torch.Generator]],
                     banned: Sequence[Sequence[int]] = (),
                     history: Sequence[tuple[Sequence[int], Sequence[int]]] = (),
                     mask: Optional[TokenMask] = None) -> DeviceSample:
    """`sample_full`'s result left on the logits' device, queued without a host sync."""
    dev = logits.device
    on = lambda values, dtype=None: _on(dev, values, dtype)  # noqa: E731
    raw = logits
    edits = any(p.logit_bias or p.penalized for p in params) or (banned and any(banned)) or mask is not None
    if edits:
        # A float32 copy: the logits may be a CUDA graph's output buffer, which must stay as it is.
        logits = logits.float() if logits.dtype != torch.float32 else logits.clone()
        apply_logit_bias(logits, params, on)
        if banned and any(banned):
            rows_b = [i for i, ids in enumerate(banned) for _ in ids]
            cols_b = [t for ids in banned for t in ids]
            logits[on(rows_b, torch.long), on(cols_b, torch.long)] = float("-inf")
        apply_penalties(logits, params, history, on)
        if mask is not None:
            apply_mask(logits, mask)
    out = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        out[on(rows, torch.long)] = _draw(logits, rows, params, generators, on)
    k = lp.wanted(params)
    return DeviceSample(out, None if k is None else lp.pack(raw, out, k))


def _draw(logits: torch.Tensor, rows: list[int], params: Sequence[SamplingParams],
          generators: Sequence[Optional[torch.Generator]], on) -> torch.Tensor:
    """The sampled tokens (long [R]) of the non-greedy `rows`."""
    dev = logits.device
    idx = on(rows, torch.long)
    x = logits[idx].float()  # the model's dtype (LlamaModel.compute_logits): temperature and softmax in fp32
    temp = on([params[i].temperature for i in rows], x.dtype)
    x = x / temp[:, None]
    minp_list = [params[i].min_p for i in rows]
    if any(m > 0.0 for m in minp_list):
        # p_i < min_p * p_max  <=>  x_i < x_max + log(min_p), in logit space (no softmax needed).
        minp = on(minp_list, x.dtype)
        x = x.masked_fill(x < x.max(dim=-1, keepdim=True).values + minp.log()[:, None], float("-inf"))
    topk = [params[i].top_k if params[i].top_k > 0 else x.shape[1] for i in rows]
    if any(k < x.shape[1] for k in topk):
        k_t = on(topk, torch.long)
        sorted_desc = x.sort(dim=-1, descending=True).values
        kth = sorted_desc.gather(1, (k_t - 1)[:, None])
        x = x.masked_fill(x < kth, float("-inf"))
    topp_list = [params[i].top_p for i in rows]
    if any(p < 1.0 for p in topp_list):
        topp = on(topp_list, x.dtype)
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
        noise[on(unseeded, torch.long)] = torch.empty(len(unseeded), probs.shape[1], device=dev,
                                                      dtype=probs.dtype).exponential_()
    for j, i in enumerate(rows):
        g = generators[i]
        if g is not None:
            noise[j].exponential_(generator=g)
    # E > 0 almost surely; the clamp keeps a masked token (p = 0) at 0 rather than 0/0.
    return (probs / noise.clamp_min(1e-20)).argmax(dim=-1)
