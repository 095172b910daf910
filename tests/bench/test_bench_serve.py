"""`appliance bench serve`: end to end against a real `appliance serve` subprocess (a tokenizer-less
shape model through streamed /generate; the tiny model with the default tokenizer through the openai
client's chat and completions), against an existing server (--url, key from the environment, 429s
counted), and its torch-free parts: options, length distributions, statistics, /metrics parsing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.bench.serve_client import Result
from appliance.bench.serve_options import ServeOptions
from appliance.bench.serve_stats import counter_deltas, counter_samples, server_summary, summarize
from appliance.bench.workload import prompts_of_lengths, random_prompts, sample_lengths
from appliance.cli import _bench_serve_parser, main
from appliance.config.schema import ConfigError
from tests.bench.test_bench_cli import TINY

SHAPE = ["model.init=random", "model.source=null", "model.name=tiny", "model.dtype=float32", "model.device=cpu",
         "model.max_model_len=128"]
SMALL = ["--no-progress", "--num-requests", "8", "--output-len", "4"]


def _check_latency(d: dict) -> None:
    assert set(d) == {"mean", "p50", "p90", "p99"}
    assert 0 <= d["p50"] <= d["p90"] <= d["p99"] and d["mean"] > 0


def _check_row(r: dict, requests: int, output_len: int) -> None:
    assert r["requests"] == r["ok"] == requests and r["failures"] == {} and r["first_errors"] == {}
    assert r["output_tokens"] == requests * output_len and r["output_len_mismatch"] == 0
    assert r["out_tok_s"] > 0 and r["req_s"] > 0 and r["wall_s"] > 0
    for k in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        _check_latency(r[k])
    assert r["ttft_ms"]["p99"] <= r["e2e_ms"]["p99"]
    # The server's own counters over the measured requests only (the warm-up is before the first scrape).
    s = r["server"]
    assert s["requests_by_reason"] == {"stop": 0, "length": requests, "abort": 0, "error": 0}
    assert s["generation_tokens"] == requests * output_len and s["load_errors"] == 0
    assert r["metrics_delta"]["appliance_generation_tokens_total"] == requests * output_len


def test_serve_generate_shape_model_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    shape = tmp_path / "shape"
    shape.mkdir()
    (shape / "config.json").write_text(json.dumps(TINY))
    out, adir = tmp_path / "out", tmp_path / "adapters"
    rc = main(["bench", "serve", "--out", str(out), *SMALL, "--prompt-len", "8", "--concurrency", "2,4",
               "--rate", "50", "--mix", "base,uniform,one", "--adapters", "2", "--rank", "8",
               "--adapter-dir", str(adir), f"model.path={shape}", *SHAPE, "lora.max_loras_per_batch=2"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    res = json.loads((out / "serve.json").read_text())
    assert set(res) == {"meta", "workload", "server", "adapters", "rows", "plots", "errors"}
    assert res["errors"] == {}
    assert res["workload"]["api"] == "generate" and res["workload"]["ignore_eos"] is True
    assert res["workload"]["prompt_len"] == {"dist": "fixed", "mean": 8, "min": 8, "max": 8}
    srv = res["server"]
    assert srv["started"] and srv["base_model"] == "tiny" and srv["exit_status"] == 0
    assert Path(srv["log"]).is_file()
    # The generated admin key went through the child's environment: never into the report.
    assert "server.admin_key=${oc.env:APPLIANCE_ADMIN_KEY}" in srv["overrides"]
    assert res["adapters"] == {"source": "synthetic", "count": 2, "rank": 8, "targets": ServeOptions().targets,
                               "dir": str(adir)}
    assert sorted(p.name for p in adir.iterdir()) == ["r8-0000", "r8-0001"]  # kept: --adapter-dir
    rows = res["rows"]
    assert [(r["mix"], r["load"], r["concurrency"], r["rate_rps"]) for r in rows] == [
        (m, load, c, rate) for m in ("base", "uniform", "one")
        for load, c, rate in (("closed", 2, None), ("closed", 4, None), ("poisson", None, 50.0))]
    for r in rows:
        _check_row(r, 8, 4)
        assert r["prompt_tokens_mean"] == 8
        if r["load"] == "closed":  # the same requests through the engine in process, closed loop
            ip = r["in_process"]
            assert ip["ok"] == 8 and ip["failures"] == {} and ip["out_tok_s"] > 0
            _check_latency(ip["ttft_ms"])
            assert r["http_vs_in_process"] == round(r["out_tok_s"] / ip["out_tok_s"], 4) > 0
        else:
            assert "in_process" not in r
    assert all(r["server"]["slot_loads"] == 0 for r in rows if r["mix"] == "base")
    assert "| uniform | 4 concurrent | 8 | 8 | 0 |" in printed and printed.rstrip().endswith("serve.json")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert res["plots"][0].startswith("plots skipped")
    else:
        assert res["plots"] == [str(out / "serve.png")] and (out / "serve.png").stat().st_size > 1000


def test_serve_spreads_the_client_over_processes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--client-procs 2: each load point's requests split over two client processes, every request
    measured once, the server's counters taken around the measured requests only."""
    shape = tmp_path / "shape"
    shape.mkdir()
    (shape / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "out"
    rc = main(["bench", "serve", "--out", str(out), *SMALL, "--prompt-len", "8", "--concurrency", "3",
               "--rate", "50", "--mix", "one", "--adapters", "1", "--rank", "8", "--client-procs", "2",
               "--no-compare-in-process", f"model.path={shape}", *SHAPE, "lora.max_loras_per_batch=2"])
    assert rc == 0, capsys.readouterr().out
    rows = json.loads((out / "serve.json").read_text())["rows"]
    assert [(r["load"], r["client_processes"]) for r in rows] == [("closed", 2), ("poisson", 2)]
    for r in rows:
        _check_row(r, 8, 4)
        assert 0 < r["client_cpu_util"]


def test_serve_shared_prefix_workload_with_the_cache_on_and_off(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    """--shared-prefix-len: every prompt starts with its adapter's fixed prefix; the server's prefix
    cache serves it (hit ratio in the report), and the Hydra override turns the cache off."""
    shape = tmp_path / "shape"
    shape.mkdir()
    (shape / "config.json").write_text(json.dumps(TINY))
    ratios = {}
    for caching in ("true", "false"):
        out = tmp_path / f"out-{caching}"
        rc = main(["bench", "serve", "--out", str(out), *SMALL, "--prompt-len", "8", "--shared-prefix-len", "48",
                   "--concurrency", "2", "--mix", "uniform", "--adapters", "2", "--rank", "8",
                   "--no-compare-in-process", f"model.path={shape}", *SHAPE, "lora.max_loras_per_batch=2",
                   f"engine.enable_prefix_caching={caching}"])
        assert rc == 0, capsys.readouterr().out
        res = json.loads((out / "serve.json").read_text())
        assert res["workload"]["shared_prefix_len"] == 48
        [r] = res["rows"]
        _check_row(r, 8, 4)
        assert r["prompt_tokens_mean"] == 48 + 8
        ratios[caching] = r["server"]["prefix_cache_hit_ratio"]
    # 8 requests over 3 prefixes warmed up before the row: each request finds its 48-token prefix
    # (3 blocks of 16) cached, of its 56 tokens.
    assert ratios == {"true": round(48 / 56, 4), "false": None}


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_serve_openai_routes_end_to_end(api: str, tmp_path: Path, tiny_model_dir: Path,
                                        capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    rc = main(["bench", "serve", "--out", str(out), *SMALL, "--api", api, "--prompt-len", "12",
               "--prompt-dist", "uniform", "--concurrency", "4", "--mix", "zipf", "--adapters", "2", "--rank", "4",
               f"model.path={tiny_model_dir}", "model.name=tiny", "model.source=null", "model.device=cpu",
               "model.max_model_len=256"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    res = json.loads((out / "serve.json").read_text())
    assert res["workload"]["api"] == api and res["server"]["exit_status"] == 0
    [r] = res["rows"]
    _check_row(r, 8, 4)
    assert r["in_process"]["ok"] == 8 and r["http_vs_in_process"] > 0
    # Completions send the token ids as they are; chat sends their text inside the chat template.
    if api == "completions":
        assert 6 <= r["prompt_tokens_mean"] <= 18
    else:
        assert r["prompt_tokens_mean"] > 12
    assert not Path(res["adapters"]["dir"]).exists()  # a temp dir, removed after


def test_serve_existing_server_counts_429(tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture) -> None:
    from tests.server.conftest import API_KEY, start_server

    srv = start_server(f"model.path={tiny_model_dir}", "model.name=tiny", "model.device=cpu",
                       "model.max_model_len=256", f"server.api_keys=[{API_KEY}]", "server.max_concurrent_requests=1")
    monkeypatch.setenv("APPLIANCE_API_KEY", API_KEY)
    try:
        out = tmp_path / "out"
        rc = main(["bench", "serve", "--url", srv.url, "--out", str(out), *SMALL, "--concurrency", "4",
                   f"model.path={tiny_model_dir}", "model.source=null"])
    finally:
        srv.stop()
    printed = capsys.readouterr().out
    assert rc == 1, printed  # failures make the exit status 1
    res = json.loads((out / "serve.json").read_text())
    assert not res["server"]["started"] and res["server"]["url"] == srv.url
    [r] = res["rows"]
    # One request at a time is admitted; the rest of each wave is refused with 429, counted by status.
    assert set(r["failures"]) == {"429"} and r["ok"] + r["failures"]["429"] == 8 and r["ok"] >= 1
    assert "max_concurrent_requests" in r["first_errors"]["429"]
    assert "in_process" not in r  # not by default against an existing server
    assert API_KEY not in (out / "serve.json").read_text() and API_KEY not in printed


# ------------------------------------------------------------------------------------------ torch-free parts

def test_options_parse_without_torch() -> None:
    code = ("import sys; from appliance.cli import _bench_serve_parser; "
            "a = _bench_serve_parser().parse_args(['--concurrency', '64,256', '--rate', '4,16', '--mix', 'base,one']); "
            "assert a.concurrency == [64, 256] and a.rate == [4.0, 16.0] and a.mixes == ['base', 'one'], a; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def test_options_defaults_and_checks() -> None:
    args = _bench_serve_parser().parse_args(["--adapters", "32", "--mix", "base,uniform,one", "model=llama3-8b-shape"])
    assert args.adapters == 32 and args.overrides == ["model=llama3-8b-shape"] and args.compare_in_process is None
    assert args.concurrency is None and args.rate == []  # cli.py: [8] then, or [] when --rate is given
    o = ServeOptions()
    o.check()
    assert o.in_process and not ServeOptions(url="http://127.0.0.1:1").in_process
    assert ServeOptions(url="http://h:1", compare_in_process=True).in_process
    for bad, words in ((dict(concurrency=[], rate=[]), "load point"), (dict(mixes=["uniform"]), "need adapters"),
                       (dict(mixes=["bogus"]), "--mix"), (dict(adapters=2, config_adapters=True), "exclude"),
                       (dict(rate=[0.0]), "--rate"), (dict(prompt_dist="normal"), "--prompt-dist"),
                       (dict(url="127.0.0.1:8000"), "--url"), (dict(targets=["qkv"]), "--targets"),
                       (dict(shared_prefix_len=-1), "--shared-prefix-len")):
        with pytest.raises(ConfigError, match=words):
            ServeOptions(**bad).check()


def test_keys_masked_in_the_report() -> None:
    from appliance.bench.serve import masked

    env_key = "server.admin_key=${oc.env:APPLIANCE_ADMIN_KEY}"
    assert masked(["model=x", "server.admin_key=s3cret", "server.api_keys=[a,b]", env_key,
                   "appliance bench serve server.admin_key=k x=1"]) == [
        "model=x", "server.admin_key=***", "server.api_keys=***", env_key,
        "appliance bench serve server.admin_key=*** x=1"]


def test_bad_options_exit_1(capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "serve", "--mix", "uniform", "model.device=cpu"]) == 1
    assert "adapter mixes need adapters" in capsys.readouterr().err


def test_length_distributions() -> None:
    assert sample_lengths(5, 7, "fixed", 0) == [7] * 5
    u = sample_lengths(500, 100, "uniform", 0, range_ratio=0.25)
    assert min(u) >= 75 and max(u) <= 125 and min(u) < 85 and max(u) > 115
    ln = sample_lengths(4000, 100, "lognormal", 0)
    assert 90 < sum(ln) / len(ln) < 110 and max(ln) > 300 and min(ln) >= 1 and max(ln) <= 800
    assert max(sample_lengths(100, 100, "lognormal", 0, cap=120)) == 120
    assert sample_lengths(50, 100, "uniform", 3) == sample_lengths(50, 100, "uniform", 3)  # seeded
    p = prompts_of_lengths([3, 1, 5], 512, 0)
    assert [len(x) for x in p] == [3, 1, 5] and all(10 <= t < 512 for x in p for t in x)
    assert random_prompts(2, 4, 512, 9) == prompts_of_lengths([4, 4], 512, 9)


def test_summarize_percentiles_and_failures() -> None:
    ok = [Result(ok=True, ttft_s=0.01 * i, itl_s=[0.001 * i] * 3, e2e_s=0.1 + 0.01 * i, output_tokens=4,
                 prompt_tokens=10) for i in range(1, 11)]
    bad = [Result(ok=False, failure="429", error="busy"), Result(ok=False, failure="429", error="busy again"),
           Result(ok=False, failure="stream_error:engine_error", error="boom")]
    s = summarize(ok + bad, 2.0, [4] * 9 + [5] + [4] * 3)
    assert s["requests"] == 13 and s["ok"] == 10 and s["output_len_mismatch"] == 1
    assert s["failures"] == {"429": 2, "stream_error:engine_error": 1}
    assert s["first_errors"] == {"429": "busy", "stream_error:engine_error": "boom"}
    assert s["out_tok_s"] == 20 and s["req_s"] == 5 and s["in_tok_s"] == 50
    assert s["ttft_ms"] == {"mean": 55.0, "p50": 50.0, "p90": 90.0, "p99": 100.0}
    assert s["tpot_ms"]["p50"] == 33.333  # (e2e - ttft) / 3 = 0.1 / 3
    assert summarize(bad, 1.0, [4] * 3)["ttft_ms"] is None


def test_metrics_deltas() -> None:
    page = """# HELP appliance_requests Finished requests.
# TYPE appliance_requests_total counter
appliance_requests_total{adapter="base",finish_reason="length"} 3.0
appliance_requests_total{adapter="a",finish_reason="length"} %s
# TYPE appliance_lora_evictions_total counter
appliance_lora_evictions_total{policy="lru",tier="gpu"} %s
# TYPE appliance_lora_slot_wait_seconds histogram
appliance_lora_slot_wait_seconds_bucket{le="0.1"} 1.0
appliance_lora_slot_wait_seconds_bucket{le="+Inf"} %s
appliance_lora_slot_wait_seconds_count %s
appliance_lora_slot_wait_seconds_sum %s
# TYPE appliance_engine_step_tokens histogram
appliance_engine_step_tokens_bucket{le="+Inf",path="eager"} %s
appliance_engine_step_tokens_count{path="eager"} %s
appliance_engine_step_tokens_sum{path="eager"} %s
# TYPE appliance_requests_running gauge
appliance_requests_running 7.0
"""
    before = counter_samples(page % (1, 0, 1, 1, 0.0, 1, 1, 600))
    after = counter_samples(page % (5, 2, 3, 3, 0.5, 3, 3, 3000))
    assert before['appliance_requests_total{finish_reason="length"}'] == 4  # summed over `adapter`
    d = counter_deltas(before, after)
    assert d == {'appliance_engine_step_tokens_count{path="eager"}': 2,
                 'appliance_engine_step_tokens_sum{path="eager"}': 2400,
                 'appliance_lora_evictions_total{policy="lru",tier="gpu"}': 2,
                 "appliance_lora_slot_wait_seconds_count": 2, "appliance_lora_slot_wait_seconds_sum": 0.5,
                 'appliance_requests_total{finish_reason="length"}': 4}
    s = server_summary(d)
    assert s["slot_evictions"] == 2 and s["slot_waits"] == 2 and s["slot_wait_mean_ms"] == 250
    assert s["requests_by_reason"]["length"] == 4 and s["preemptions"] == 0 and s["queue_time_mean_ms"] is None
    assert s["step_tokens_mean_by_path"] == {"graph": None, "piecewise": None, "eager": 1200}
