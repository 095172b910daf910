"""`n` and `best_of`: several samples of each prompt, as jobs that share the prompt's KV in the engine.

Each prompt becomes `best_of` jobs (`n` when best_of is unset); the first computes the prompt and the
others name it as their `prompt_source` (engine/scheduler.py shares its full blocks). A seeded request's
k-th sample uses seed + k, so the samples differ and the request stays reproducible. With best_of > n
the `n` samples of highest cumulative logprob (the sum over their tokens, as vLLM) are returned, best
first; usage counts every sample's tokens and each prompt once.
"""

from __future__ import annotations

import dataclasses

from appliance.server.protocol import Choice, Job


def expand(jobs: list[Job], best_of: int, ranked: bool) -> list[Job]:
    """`best_of` jobs per job, in prompt order. `ranked`: the choices will be ranked (select), so
    every sample computes its tokens' logprobs."""
    out: list[Job] = []
    for job in jobs:
        first = len(out)
        for k in range(best_of):
            p = dataclasses.replace(job.params, stop=list(job.params.stop),
                                    stop_token_ids=list(job.params.stop_token_ids),
                                    logit_bias=dict(job.params.logit_bias))
            if p.seed is not None and k:
                p.seed = (p.seed + k) % 2**63
            if ranked and p.logprobs is None:
                p.logprobs = 0
            out.append(dataclasses.replace(job, params=p, prompt_source=None if k == 0 else first))
    return out


def select(choices: list[Choice], n: int, best_of: int, keep_logprobs: bool) -> list[Choice]:
    """The `n` best of each prompt's `best_of` choices (highest cumulative logprob first); their
    logprobs are dropped unless the request asked for them."""
    out: list[Choice] = []
    for start in range(0, len(choices), best_of):
        group = choices[start:start + best_of]
        ranked = sorted(group, key=lambda c: -sum(lp.logprob for lp in c.logprobs or []))[:n]
        for c in ranked:
            out.append(c if keep_logprobs else dataclasses.replace(c, logprobs=None))
    return out
