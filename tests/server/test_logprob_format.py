"""The logprob response shapes (OpenAI chat and completions, SGLang /generate) on a real tokenizer."""

from __future__ import annotations

from pathlib import Path

from appliance.engine.request import TokenLogprob
from appliance.engine.tokenizer import Tokenizer
from appliance.server import logprob_format as fmt


def test_shapes(default_model_dir: Path) -> None:
    tok = Tokenizer(default_model_dir)
    a, b = tok.encode(" Paris", add_special_tokens=False)[0], tok.encode(" London", add_special_tokens=False)[0]
    lps = [TokenLogprob(a, -0.5, [(a, -0.5), (b, -1.5)]), TokenLogprob(b, -2.0, [(a, -0.1), (b, -2.0)])]
    c = fmt.chat(tok, lps)
    assert c["refusal"] is None and [e["token"] for e in c["content"]] == [" Paris", " London"]
    assert c["content"][0]["bytes"] == list(b" Paris") and c["content"][1]["logprob"] == -2.0
    assert [t["token"] for t in c["content"][1]["top_logprobs"]] == [" Paris", " London"]
    o = fmt.completion(tok, lps, offset=3)
    assert o == {"tokens": [" Paris", " London"], "token_logprobs": [-0.5, -2.0],
                 "top_logprobs": [{" Paris": -0.5, " London": -1.5}, {" Paris": -0.1, " London": -2.0}],
                 "text_offset": [3, 9]}
    assert fmt.completion_chars(tok, lps) == 13
    g = fmt.generate(None, lps)
    assert g["output_token_logprobs"] == [[-0.5, a, None], [-2.0, b, None]]
    assert g["output_top_logprobs"][1] == [[-0.1, a, None], [-2.0, b, None]]
    assert fmt.generate(tok, lps[:1])["output_token_logprobs"] == [[-0.5, a, " Paris"]]
