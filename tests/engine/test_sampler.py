from __future__ import annotations

import torch

from appliance.engine.request import SamplingParams
from appliance.engine.sampler import sample


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax_and_banned_tokens_are_skipped() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 2.0]])
    p = SamplingParams(temperature=0.0)
    assert sample(logits, [p, p], [None, None]) == [1, 0]
    assert sample(logits, [p, p], [None, None], banned=[[1], []]) == [2, 0]


def test_top_k_one_is_greedy_and_top_k_limits_support() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 50)
    top3 = set(logits[0].topk(3).indices.tolist())
    p = SamplingParams(temperature=1.0, top_k=3)
    draws = {sample(logits, [p], [gen(i)])[0] for i in range(200)}
    assert draws <= top3 and len(draws) > 1


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    p = SamplingParams(temperature=1.0, top_p=0.7)
    draws = {sample(probs.log(), [p], [gen(i)])[0] for i in range(300)}
    assert draws == {0, 1}


def test_same_seed_same_draws_regardless_of_batch() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 100)
    p = SamplingParams(temperature=0.8)
    alone = [sample(logits[1:2], [p], [gen(42)])[0] for _ in range(1)]
    batch = sample(logits, [p, p, p], [gen(1), gen(42), gen(3)])
    assert batch[1] == alone[0]


def test_sampled_frequencies_follow_the_distribution() -> None:
    # The exponential race must pick token i with probability p_i (a wrong race, e.g. p * E, would
    # pick the top token far more often).
    probs = torch.tensor([[0.5, 0.3, 0.2]])
    p = SamplingParams(temperature=1.0)
    draws = sample(probs.log().expand(4000, 3).contiguous(), [p] * 4000, [None] * 4000)
    freq = torch.bincount(torch.tensor(draws), minlength=3).float() / 4000
    assert torch.allclose(freq, probs[0], atol=0.03), freq


def test_greedy_and_sampled_rows_mix_with_one_result_list() -> None:
    torch.manual_seed(3)
    logits = torch.randn(4, 30)
    greedy = SamplingParams(temperature=0.0)
    hot = SamplingParams(temperature=0.7, top_k=5, top_p=0.9)
    out = sample(logits, [greedy, hot, greedy, hot], [None, gen(7), None, None])
    assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())
    assert out[1] in logits[1].topk(5).indices.tolist() and out[3] in logits[3].topk(5).indices.tolist()
    assert sample(logits, [greedy, hot, greedy, hot], [None, gen(7), None, None])[1] == out[1]
