"""`appliance bench serve --cold-adapters`: the whole cold-adapter mix end to end against a real
`appliance serve` subprocess and moto's S3 API server started by the bench (the regular rows' K extra
requests served by warm adapters with nothing fetched, every cold adapter fetched and read once, every
steady request served, the paired rows and their ratio in the report, the store's credentials nowhere
in it), against an existing store (uploads deleted after), and its torch-free parts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from appliance.bench.adapters import adapter_name
from appliance.bench.serve_client import RequestSpec
from appliance.bench.serve_cold import (COLD_ITL_LIMIT, ColdMix, allowed_entry, check_cold_options, failed,
                                        render_cold)
from appliance.bench.serve_options import ServeOptions
from appliance.cli import main
from appliance.config.schema import ConfigError
from tests.bench.test_bench_cli import TINY
from tests.bench.test_bench_serve import SHAPE

K = 2  # cold adapters per row
STEADY = 8  # measured steady requests per row
OUT_LEN = 8


def _shape(tmp_path: Path) -> Path:
    shape = tmp_path / "shape"
    shape.mkdir()
    (shape / "config.json").write_text(json.dumps(TINY))
    return shape


def _bench(tmp_path: Path, *extra: str) -> list[str]:
    return ["bench", "serve", "--out", str(tmp_path / "out"), "--no-progress", "--num-requests", str(STEADY),
            "--prompt-len", "8", "--output-len", str(OUT_LEN), "--concurrency", "2", "--mix", "uniform",
            "--adapters", "1", "--rank", "8", "--cold-adapters", str(K), "--cold-start-s", "0",
            "--cold-interval-s", "0.05", "--cold-output-len", "4", "--no-compare-in-process",
            f"model.path={_shape(tmp_path)}", *SHAPE, "lora.max_loras_per_batch=4", *extra]


def _check_extras(x: dict, kind: str) -> None:
    """K extra requests of `kind`, all served, sent cold_interval_s apart from cold_start_s (0)."""
    assert x["kind"] == kind and x["requests"] == x["ok"] == K and x["failures"] == {} and x["load_errors"] == 0
    assert 0 < x["ttft_ms"]["p50"] <= x["ttft_max_ms"] and len(x["sent_s"]) == K and 0 <= x["in_window"] <= K
    assert x["sent_s"][0] < x["sent_s"][1] and x["sent_s"][1] >= 0.05


def _check_cold_row(res: dict) -> dict:
    [regular] = res["rows"]
    # The no-loads side serves K extra requests too, at the same times, to the adapter it already holds:
    # nothing fetched or read.
    assert regular["ok"] == STEADY and regular["server"]["cold_reads"] == 0
    warm = regular["extras"]
    _check_extras(warm, "warm")
    assert warm["names"] == [adapter_name(8, 0)] * K  # the uniform mix's one adapter, loaded before the rows
    assert warm["fetches"] == 0 and warm["reads"] == 0 and warm["fetch_mean_ms"] is None
    assert regular["server"]["requests_by_reason"]["length"] == STEADY + K
    assert regular["server"]["generation_tokens"] == STEADY * OUT_LEN + K * 4
    [r] = res["cold"]["rows"]
    assert (r["mix"], r["load"], r["concurrency"]) == ("uniform", "closed", 2)
    # The steady requests alone: all served, their own tokens; the server served the cold ones besides.
    w = r["with_loads"]
    assert w["requests"] == w["ok"] == STEADY and w["failures"] == {} and w["output_len_mismatch"] == 0
    assert w["output_tokens"] == STEADY * OUT_LEN
    assert w["server"]["requests_by_reason"]["length"] == STEADY + K
    assert w["server"]["generation_tokens"] == STEADY * OUT_LEN + K * 4
    assert r["no_loads"]["ok"] == STEADY and r["no_loads"]["itl_ms"] == regular["itl_ms"] and r["warm"] == warm
    # Each cold adapter looked up, fetched from the store and read once, then served.
    c = r["cold"]
    _check_extras(c, "cold")
    assert len(set(c["names"])) == K and not set(c["names"]) & set(warm["names"])
    assert c["fetches"] == K and c["reads"] == K and c["fetch_mean_ms"] > 0
    assert r["itl_p99_ratio"] == round(w["itl_ms"]["p99"] / regular["itl_ms"]["p99"], 4)
    assert r["limit"] == COLD_ITL_LIMIT
    # Judged only when every extra request of both sides overlapped the steady requests (a tiny CPU run
    # may outpace them).
    seen = c["in_window"] == K and warm["in_window"] == K
    assert r["met"] == (r["itl_p99_ratio"] <= COLD_ITL_LIMIT if seen else None)
    return r


def test_cold_mix_through_moto_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rc = main(_bench(tmp_path))
    printed = capsys.readouterr().out
    assert rc == 0, printed
    out = tmp_path / "out"
    text = (out / "serve.json").read_text()
    res = json.loads(text)
    assert res["errors"] == {} and res["server"]["exit_status"] == 0
    cold = res["cold"]
    assert cold["source"] == "moto" and cold["template"] == "s3://appliance-bench/cold/{name}"
    assert cold["adapters"] == K and cold["rank"] == 8 and cold["adapter_bytes"] > 0
    assert "lora.resolver.sources=['s3://appliance-bench/cold/{name}']" in res["server"]["overrides"]
    r = _check_cold_row(res)
    # The moto credentials went to the server in its environment only.
    log = (out / "server.log").read_text() + (out / "moto.log").read_text()
    assert "AKIA" not in text and "AKIA" not in printed and "AKIA" not in log
    assert "GET /appliance-bench/cold/" in (out / "moto.log").read_text()
    assert "## cold loads: 2 rank-8 adapters" in printed
    assert "Each row also served 2 extra requests to warm adapters, timed apart from its requests" in printed
    lines = printed.splitlines()
    [none] = [x for x in lines if x.startswith("| uniform | 2 concurrent | none | 8/8 | 0 |")]
    [loads] = [x for x in lines if x.startswith("| uniform | 2 concurrent | 2 cold | 8/8 | 0 |")]
    assert "| 2 warm | 2/2 |" in none and none.endswith("| 0 |  |  |  |")  # fetched 0, no ratio of its own
    assert "| 2 cold | 2/2 |" in loads and "| 2 | " in loads
    assert f"| {r['itl_p99_ratio']} | <= 1.2 |" in printed


def test_cold_mix_against_an_existing_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture) -> None:
    """--cold-source s3://...: the bench uploads to the store the environment's credentials and
    lora.s3_endpoint_url name, and deletes what it uploaded after."""
    import boto3
    from moto.server import ThreadedMotoServer

    for k, v in (("AWS_ACCESS_KEY_ID", "AKIACOLDTESTKEY"), ("AWS_SECRET_ACCESS_KEY", "cold-secret"),
                 ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(k, v)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        url = f"http://{host}:{port}"
        s3 = boto3.session.Session().client("s3", endpoint_url=url, region_name="us-east-1")
        s3.create_bucket(Bucket="team")
        rc = main(_bench(tmp_path, "--cold-source", "s3://team/lazy/{name}", f"lora.s3_endpoint_url={url}",
                         "lora.s3_region=us-east-1"))
        printed = capsys.readouterr().out
        assert rc == 0, printed
        res = json.loads((tmp_path / "out" / "serve.json").read_text())
        assert res["cold"]["template"] == "s3://team/lazy/{name}"
        assert "lora.allowed_sources=['s3://team/lazy']" in res["server"]["overrides"]
        _check_cold_row(res)
        assert s3.list_objects_v2(Bucket="team").get("KeyCount") == 0  # its uploads deleted
    finally:
        server.stop()


# ------------------------------------------------------------------------------------------ torch-free parts

def test_cold_options() -> None:
    ServeOptions(cold_adapters=8).check()
    ServeOptions(cold_adapters=2, cold_source="s3://b/p/{name}", url="http://h:1").check()
    ServeOptions(cold_source="nonsense").check()  # unused without --cold-adapters
    for bad, words in ((dict(cold_adapters=-1), "--cold-adapters"), (dict(cold_start_s=-1), "--cold-start-s"),
                       (dict(cold_output_len=0), "--cold-output-len"),
                       (dict(cold_adapters=1, url="http://h:1"), "only a server the bench starts"),
                       (dict(cold_adapters=1, cold_source="hf://org/{name}"), "s3:// template"),
                       (dict(cold_adapters=1, cold_source="s3://b/{name}/x"), "ending in"),
                       (dict(cold_adapters=1, cold_source="s3://b/p"), "ending in")):
        with pytest.raises(ConfigError, match=words):
            check_cold_options(ServeOptions(**bad))
    assert allowed_entry("s3://b/p/q/{name}") == "s3://b/p/q" and allowed_entry("s3://b/{name}") == "s3://b"


def test_cold_table_and_failures() -> None:
    lat = {"mean": 1.0, "p50": 1.0, "p90": 2.0, "p99": 3.0}
    steady = {"requests": 4, "ok": 4, "failures": {}, "out_tok_s": 10.0, "ttft_ms": lat, "itl_ms": lat}
    extras = {"requests": 2, "ok": 2, "failures": {}, "in_window": 2}
    row = {"mix": "base", "load": "closed", "concurrency": 4, "rate_rps": None, "no_loads": steady,
           "with_loads": {**steady, "itl_ms": {**lat, "p99": 3.3}},
           "warm": {**extras, "kind": "warm", "ttft_ms": {**lat, "p50": 20.0}, "ttft_max_ms": 30.0, "fetches": 0},
           "cold": {**extras, "kind": "cold", "ttft_ms": {**lat, "p50": 250.0}, "ttft_max_ms": 300.0, "fetches": 2},
           "itl_p99_ratio": 1.1, "limit": 1.2, "met": True}
    res = {"cold": {"adapters": 2, "rank": 16, "adapter_bytes": 2 << 20, "template": "s3://b/{name}", "start_s": 1.0,
                    "interval_s": 0.5, "rows": [row]}}
    text = render_cold(res)
    assert "2 rank-16 adapters (2.0 MiB each) from s3://b/{name}" in text
    assert "the no-loads line sends as many requests to warm adapters at the same times" in text
    assert ("| base | 4 concurrent | none | 4/4 | 0 | 10.0 | 1.0 | 3.0 | 1.0 | 3.0 | 2 warm | 2/2 | 2/2 | 20.0 | 30.0 "
            "| 0 |  |  |  |") in text
    assert ("| base | 4 concurrent | 2 cold | 4/4 | 0 | 10.0 | 1.0 | 3.0 | 1.0 | 3.3 | 2 cold | 2/2 | 2/2 | 250.0 "
            "| 300.0 | 2 | 1.1 | <= 1.2 | True |") in text
    assert not failed(res) and not failed({})
    row["cold"]["failures"] = {"404": 1}
    assert failed(res)
    row["cold"]["failures"] = {}
    res["rows"] = [{"extras": {**extras, "failures": {"timeout": 1}}}]  # a regular row's warm extra failed
    assert failed(res)


def test_cold_workload_sends_each_row_as_many_warm_extras(tmp_path: Path) -> None:
    """Row j (mix-major, then load point): K warm extras over the adapters its mix already serves, in
    turn (the base model for `base`), and K cold ones under that row's new names, of equal lengths and
    on prompts of their own; the steady specs again on fresh prompts, same lengths and adapters."""
    mixes = {"base": [None] * 4, "uniform": ["b", "a", "b", "a"], "one": ["a"] * 4}
    opts = ServeOptions(mixes=list(mixes), adapters=2, cold_adapters=3, shared_prefix_len=2)
    specs = {m: [RequestSpec(list(range(5 + i)), "", 3 + i, a) for i, a in enumerate(ads)] for m, ads in mixes.items()}
    mix = ColdMix(opts, tmp_path, points=2)
    w = mix.workload(specs, 1000, None)
    assert len(w.warm) == len(w.cold) == len(mix.names) == 6
    held = {"base": [None] * 3, "uniform": ["b", "a", "b"], "one": ["a"] * 3}
    for j, (warm, cold) in enumerate(zip(w.warm, w.cold)):
        assert [s.adapter for s in warm] == held[opts.mixes[j // 2]] and [s.adapter for s in cold] == mix.names[j]
        assert [(len(s.prompt_ids), s.output_len) for s in warm] == [(len(s.prompt_ids), s.output_len) for s in cold]
        assert all(a.prompt_ids != b.prompt_ids for a, b in zip(warm, cold))
    assert len({n for names in mix.names for n in names}) == 18
    for m, ss in specs.items():
        fresh = w.steady[m]
        assert [(len(s.prompt_ids), s.output_len, s.adapter) for s in fresh] == [
            (len(s.prompt_ids), s.output_len, s.adapter) for s in ss]
        assert all(f.prompt_ids[:2] == s.prompt_ids[:2] and f.prompt_ids != s.prompt_ids for f, s in zip(fresh, ss))
