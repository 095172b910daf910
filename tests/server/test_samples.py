"""n / best_of: jobs per prompt (shared prompt, distinct seeds) and the choice of the best samples."""

from __future__ import annotations

from appliance.engine.request import SamplingParams, TokenLogprob
from appliance.server.protocol import Choice, Job, usage
from appliance.server.samples import expand, select


def test_expand_gives_each_prompt_best_of_jobs_sharing_its_first() -> None:
    jobs = [Job([1, 2, 3], SamplingParams(seed=10, stop=["x"])), Job([4, 5], SamplingParams())]
    out = expand(jobs, 3, ranked=True)
    assert [j.prompt_ids for j in out] == [[1, 2, 3]] * 3 + [[4, 5]] * 3
    assert [j.prompt_source for j in out] == [None, 0, 0, None, 3, 3]
    assert [j.params.seed for j in out[:3]] == [10, 11, 12] and out[3].params.seed is None
    assert all(j.params.logprobs == 0 for j in out)  # ranking needs each sample's logprob
    out[1].params.stop.append("y")
    assert jobs[0].params.stop == ["x"]  # copies, not shared lists
    assert expand(jobs, 2, ranked=False)[1].params.logprobs is None


def test_select_keeps_the_n_most_likely_of_each_prompt_and_usage_counts_everything() -> None:
    def choice(text: str, lps: list[float], first: bool) -> Choice:
        return Choice(prompt_tokens=5, text=text, completion_tokens=len(lps), counts_prompt=first,
                      logprobs=[TokenLogprob(0, v) for v in lps])

    sampled = [choice("a", [-1.0, -1.0], True), choice("b", [-0.1], False), choice("c", [-0.5, -0.2], False),
               choice("d", [-3.0], True), choice("e", [-0.2], False), choice("f", [-0.1], False)]
    best = select(sampled, 2, 3, keep_logprobs=False)
    assert [c.text for c in best] == ["b", "c", "f", "e"] and all(c.logprobs is None for c in best)
    assert select(sampled, 1, 3, keep_logprobs=True)[0].logprobs is not None
    assert usage(sampled) == {"prompt_tokens": 10, "completion_tokens": 8, "total_tokens": 18}
