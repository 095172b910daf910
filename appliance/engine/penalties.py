"""Logit bias and the repetition, frequency and presence penalties, batched over a step's rows.

All of it runs on the logits' device from host lists moved in pinned memory without blocking: a row's
tokens are scattered into a count matrix, so no row is handled on its own and nothing waits for the
device. Definitions (docs/sampling.md): repetition (CTRL/HF) divides a positive logit of a token seen in
the prompt or the output by the penalty and multiplies a negative one; frequency and presence (OpenAI)
subtract `frequency * count + presence * (count > 0)` over the generated tokens only.
"""

from __future__ import annotations

from typing import Callable, Sequence as Seq

import torch

from appliance.engine.request import SamplingParams

# A host list as a tensor on a device without a sync (sampler._on).
ToDevice = Callable[..., torch.Tensor]


def apply_logit_bias(x: torch.Tensor, params: Seq[SamplingParams], on: ToDevice) -> None:
    """x [N, V] float32, in place: x[i, t] += params[i].logit_bias[t]."""
    rows = [i for i, p in enumerate(params) for _ in p.logit_bias]
    if not rows:
        return
    cols = [t for p in params for t in p.logit_bias]
    vals = [b for p in params for b in p.logit_bias.values()]
    x.index_put_((on(rows, torch.long), on(cols, torch.long)), on(vals, x.dtype), accumulate=True)


def apply_penalties(x: torch.Tensor, params: Seq[SamplingParams],
                    history: Seq[tuple[Seq[int], Seq[int]]], on: ToDevice) -> None:
    """x [N, V] float32, in place; history[i] = (prompt ids, generated ids) of row i (read only for
    rows with a penalty)."""
    rows = [i for i, p in enumerate(params) if p.penalized]
    if not rows:
        return
    r, v = len(rows), x.shape[1]
    idx = on(rows, torch.long)
    sub = x[idx]  # [R, V]
    out_r = [j for j, i in enumerate(rows) for _ in history[i][1]]
    out_t = [t for i in rows for t in history[i][1]]
    counts = torch.zeros(r, v, dtype=x.dtype, device=x.device)
    if out_r:
        counts.index_put_((on(out_r, torch.long), on(out_t, torch.long)), on([1.0] * len(out_r), x.dtype),
                          accumulate=True)
    generated = counts > 0
    if any(params[i].repetition_penalty != 1.0 for i in rows):
        seen = generated.clone()
        pr_r = [j for j, i in enumerate(rows) for _ in history[i][0]]
        pr_t = [t for i in rows for t in history[i][0]]
        if pr_r:
            seen[on(pr_r, torch.long), on(pr_t, torch.long)] = True
        rep = on([params[i].repetition_penalty for i in rows], x.dtype)[:, None]
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq = on([params[i].frequency_penalty for i in rows], x.dtype)[:, None]
    pres = on([params[i].presence_penalty for i in rows], x.dtype)[:, None]
    sub = sub - freq * counts - pres * generated.to(x.dtype)
    x[idx] = sub
