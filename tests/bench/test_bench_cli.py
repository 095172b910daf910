"""`appliance bench all` end to end on a tiny shape-only model (random init, CPU, float32): every JSON
section is there with sane numbers, and peft's greedy tokens on one adapter equal the engine's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from appliance.cli import main

TINY = dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
            rope_theta=10000.0, initializer_range=0.1, tie_word_embeddings=False, eos_token_id=[2, 3],
            hidden_act="silu")


def test_bench_all_tiny_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    shape = tmp_path / "shape"
    shape.mkdir()
    (shape / "config.json").write_text(json.dumps(TINY))
    out, adir = tmp_path / "out", tmp_path / "adapters"
    rc = main(["bench", "all", "--out", str(out), "--adapter-dir", str(adir), "--no-progress",
               "--batch", "4", "--prompt-len", "8", "--new-tokens", "4", "--adapters", "0", "1", "4",
               "--ranks", "8", "--decode-batch", "6", "--decode-context", "16", "--decode-steps", "3",
               "--decode-adapters", "4", "--decode-logprobs", "5", "--prefill-requests", "4", "--prefill-len", "16", "--prefill-adapters", "2",
               "--baseline-batch", "4", "--baseline-adapters", "2", "--baseline-hf-new-tokens", "2",
               "--online-requests", "12",
               "--online-rate", "50", "--online-adapters", "6", "--online-overlap", "both",
               f"model.path={shape}", "model.init=random", "model.source=null", "model.name=tiny",
               "model.dtype=float32", "model.device=cpu", "model.max_model_len=128",
               "lora.max_loras_per_batch=2", "lora.max_loaded_loras=3",
               # One 16-token prefill per step: early sequences decode while later ones prefill.
               "engine.max_num_batched_tokens=16"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    res = json.loads((out / "bench.json").read_text())
    for section in ("meta", "ceilings", "offline", "decode_step", "prefill", "baselines", "online", "startup",
                    "targets", "plots", "errors"):
        assert section in res, section
    assert res["errors"] == {} and res["skipped"] == {}
    assert res["meta"]["model"] == "tiny" and res["meta"]["model_init"] == "random"
    assert res["ceilings"]["copy_gb_s"] > 0
    assert [(r["rank"], r["adapters"]) for r in res["offline"]] == [(0, 0), (8, 1), (8, 4)]
    for r in res["offline"]:
        assert r["tokens"] == r["requests"] * 4 and r["tok_s"] > 0
    assert [(r["adapters"], r["batch"], r["variant"]) for r in res["decode_step"]] == [
        (0, 6, "plain"), (0, 6, "logprobs5"), (4, 6, "plain"), (4, 6, "logprobs5")]
    for r in res["decode_step"]:
        assert 0 < r["floor_ms"] <= r["step_ms"] and r["x_floor"] >= 1
        assert len(r["step_ms_blocks"]) == 3 and sorted(r["step_ms_blocks"])[1] == r["step_ms"]
        assert r["compiled_during"] is None  # nothing is compiled under the interpreter
    # 4 rank-8 adapters on all 7 projections of 2 layers, float32.
    assert res["decode_step"][2]["adapter_bytes"] == 4 * 2 * 8 * (2 * (64 + 64) + 2 * (64 + 32) + 3 * (64 + 128)) * 4
    assert res["decode_step"][0]["adapter_bytes"] == 0
    assert [r["adapters"] for r in res["prefill"]] == [0, 2] and all(r["prefill_tok_s"] > 0 for r in res["prefill"])
    impls = [(r["impl"], r["adapters"], r["new_tokens"]) for r in res["baselines"]["rows"]]
    # The engine at 4 new tokens, then at the 2 transformers / peft run (--baseline-hf-new-tokens).
    assert impls == [("appliance", 0, 4), ("appliance", 1, 4), ("appliance", 2, 4), ("appliance", 0, 2),
                     ("appliance", 1, 2), ("appliance", 2, 2), ("transformers", 0, 2), ("peft", 1, 2),
                     ("peft mixed", 2, 2)]
    for r in res["baselines"]["rows"][6:]:  # their 2-token runs extended to 4 tokens
        assert r["prefill_s"] > 0 and r["token_ms"] >= 0 and r["est_new_tokens"] == 4 and r["est_tok_s"] > 0
    # The oracle: peft with the same synthetic adapter on the same random weights, greedy, float32.
    assert res["baselines"]["greedy_match"] == "4/4" and res["baselines"]["greedy_match_tokens"] == 2
    targets = {t["target"] for t in res["targets"]}
    assert "appliance / peft mixed generate, 2 distinct adapters, 2 new tokens (same run)" in targets
    assert ("appliance / peft mixed generate, 2 distinct adapters, 4 new tokens (peft mixed extended from its "
            "2-token run)") in targets
    # One engine for the offline phases, one per online run; the warm-up is off on cpu by default.
    assert [e["engine"] for e in res["startup"]] == ["offline", "online 1", "online 2"]
    assert all(e["build_s"] > 0 and e["warmup_steps"] == 0 for e in res["startup"])
    on = res["online"]
    assert on["requests"] == 12 and on["ok"] == 12 and on["failures"] == 0 and len(on["ttft_ms_all"]) == 12
    assert 0 < on["ttft_p50_ms"] <= on["ttft_p99_ms"] and 0 < on["itl_p50_ms"] <= on["itl_p99_ms"]
    assert on["slots"] == 2 and on["slot_evictions"] > 0  # 6 adapters through 2 slots: churn
    # --online-overlap both: the same workload without, then with overlap loading; a CPU tier of 3 for
    # 6 adapters means cold reads in both, inline in the first, in the background in the second.
    runs = res["online_runs"]
    assert [r["overlap_loading"] for r in runs] == [False, True] and runs[1] == on
    for r in runs:
        assert r["ok"] == 12 and r["failures"] == 0 and r["load_failures"] == 0
        assert r["cold_reads"] > 0 and r["slot_loads"] > 0 and r["cold_read_p50_ms"] > 0
        # --online-single each: the same arrivals all on the Zipf head, on the same engine: at most the
        # one load that brings it back, no churn.
        one = r["single"]
        assert one["adapter"] == "r8-0000" and one["ok"] == 12 and one["distinct_adapters_used"] == 1
        assert one["slot_evictions"] <= 1 and one["cold_reads"] <= 1 and one["slot_loads"] <= 1
        assert r["ttft_p99_vs_single"] == round(r["ttft_p99_ms"] / one["ttft_p99_ms"], 3)
        assert r["compiled_during_run"] is None  # the interpreter compiles nothing
    assert sum(t["target"].startswith("online p99 TTFT, Zipf churn / one adapter") for t in res["targets"]) == 2
    assert "| False | 12 |" in printed and "| True | 12 |" in printed
    assert {t["target"].split(",")[0] for t in res["targets"]} >= {"decode step / floor", "prefill tok/s",
                                                                   "decode step logprobs5 / plain"}
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert res["plots"] and res["plots"][0].startswith("plots skipped")
    else:
        assert sorted(Path(p).name for p in res["plots"]) == ["throughput_vs_adapters.png", "ttft_cdf.png"]
        assert all(Path(p).stat().st_size > 1000 for p in res["plots"])
    # The adapters are real PEFT dirs, kept because --adapter-dir was given.
    cfg = json.loads((adir / "r8-0000" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 8 and len(cfg["target_modules"]) == 7
    assert "| appliance | 1 |" in printed and "greedy tokens identical" in printed


def test_overlap_orders() -> None:
    from appliance.bench.options import OVERLAP_CHOICES, BenchOptions

    assert OVERLAP_CHOICES["off-on-on-off"] == (False, True, True, False)
    assert OVERLAP_CHOICES["on-off-off-on"] == (True, False, False, True)
    BenchOptions(online_overlap="on-off-off-on", online_single="first").check()


def test_bench_rejects_bad_options(capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "offline", "model.device=cpu", "--ranks", "0"]) == 1
    assert "bench --ranks" in capsys.readouterr().err
    assert main(["bench", "offline", "model.device=cpu", "--decode-logprobs", "21"]) == 1
    assert "bench --decode-logprobs" in capsys.readouterr().err
