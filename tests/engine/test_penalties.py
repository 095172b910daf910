"""Logit bias, penalties and min-p against plain-Python references of their definitions on fixed logits.

References: OpenAI's presence/frequency penalties (over generated tokens), the CTRL/HF repetition
penalty (over prompt and generated tokens), vLLM's min-p (relative to the top token's probability).
"""

from __future__ import annotations

import math

import pytest
import torch

from appliance.engine.request import RequestError, SamplingParams
from appliance.engine.sampler import sample, sample_full
from appliance.engine.penalties import apply_logit_bias, apply_penalties
from appliance.engine.sampler import _on

V = 12


def reference(logits: list[float], p: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    """logit bias, then repetition, frequency, presence, one token at a time."""
    x = list(logits)
    for t, b in p.logit_bias.items():
        x[t] += b
    for t in range(len(x)):
        if t in prompt or t in output:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        c = output.count(t)
        x[t] -= p.frequency_penalty * c + (p.presence_penalty if c > 0 else 0.0)
    return x


CASES = [
    (SamplingParams(presence_penalty=0.7), [1, 2], [3, 3, 5]),
    (SamplingParams(frequency_penalty=1.1), [1, 2], [3, 3, 5, 3]),
    (SamplingParams(repetition_penalty=1.4), [0, 4, 7], [3, 9]),
    (SamplingParams(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=0.3), [2], [2, 6, 6]),
    (SamplingParams(logit_bias={4: 3.0, 10: -100.0}), [1], [4]),
    (SamplingParams(), [1], [1, 1]),  # nothing to apply
    (SamplingParams(frequency_penalty=2.0), [5], []),  # no output yet
]


def test_penalties_and_bias_equal_the_reference_in_a_mixed_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(len(CASES), V) * 3
    x = logits.clone()
    params = [c[0] for c in CASES]
    history = [(c[1], c[2]) for c in CASES]
    on = lambda values, dtype=None: _on(x.device, values, dtype)  # noqa: E731
    apply_logit_bias(x, params, on)
    apply_penalties(x, params, history, on)
    for i, (p, prompt, output) in enumerate(CASES):
        want = torch.tensor(reference(logits[i].tolist(), p, prompt, output))
        assert torch.allclose(x[i], want, atol=1e-5), (i, x[i], want)


def test_greedy_follows_the_penalised_logits() -> None:
    logits = torch.tensor([[5.0, 4.0, 1.0]])
    assert sample(logits, [SamplingParams(temperature=0.0)], [None]) == [0]
    p = SamplingParams(temperature=0.0, frequency_penalty=0.8)
    assert sample(logits, [p], [None], history=[([], [0, 0])]) == [1]
    assert sample(logits, [SamplingParams(temperature=0.0, logit_bias={2: 10.0})], [None]) == [2]


def test_min_p_keeps_tokens_within_a_ratio_of_the_top() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.14, 0.06]])
    p = SamplingParams(temperature=1.0, min_p=0.25)  # keeps p >= 0.125: tokens 0, 1, 2
    draws = {sample(probs.log(), [p], [torch.Generator().manual_seed(i)])[0] for i in range(400)}
    assert draws == {0, 1, 2}


def test_logprobs_ignore_penalties_and_temperature() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    p = SamplingParams(temperature=0.0, logprobs=2, frequency_penalty=2.0)
    tokens, lps = sample_full(logits, [p], [None], history=[([], [0])])
    want = logits.log_softmax(-1)[0]
    assert tokens == [1] and lps is not None and lps[0] is not None
    assert math.isclose(lps[0].logprob, want[1].item(), abs_tol=1e-6)
    assert [t for t, _ in lps[0].top] == [0, 1]


@pytest.mark.parametrize("kw", [dict(presence_penalty=2.5), dict(frequency_penalty=-3.0), dict(repetition_penalty=0.0),
                                dict(min_p=1.5), dict(logprobs=21), dict(logit_bias={1: 101.0}),
                                dict(logit_bias={i: 1.0 for i in range(301)})])
def test_out_of_range_values_are_refused(kw: dict) -> None:
    with pytest.raises(RequestError):
        SamplingParams(**kw).validate()
