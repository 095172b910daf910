"""`appliance bench serve --tenant-rate`: the two-tenant fairness mix end to end against a real
`appliance serve` subprocess with the tenants file the bench writes (a tokenizer-less shape model through
streamed /generate, one synthetic adapter). What is structural is checked: B (at its share) loses no
request, A's excess gets the 429s, the server's own tenant counters agree, keys never leak. The TTFT
ratio is reported, not asserted (speed is never asserted in tests)."""

from __future__ import annotations

import hashlib
import itertools
import json
import secrets
from pathlib import Path

import pytest

from appliance.bench import serve_tenants
from appliance.bench.serve_options import ServeOptions
from appliance.bench.serve_tenants import FLOOD, STEADY, TenantPlan
from appliance.cli import main
from appliance.config.schema import ConfigError
from tests.bench.test_bench_cli import TINY
from tests.bench.test_bench_serve import SHAPE


def test_two_tenant_mix_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # Recognisable keys, so the test can look for them everywhere the run writes.
    made: list[str] = []
    counter = itertools.count()

    def token(n: int = 24) -> str:
        made.append(f"bench-secret-{next(counter)}-{'x' * n}")
        return made[-1]

    monkeypatch.setattr(secrets, "token_urlsafe", token)
    for var in ("APPLIANCE_API_KEY", "APPLIANCE_ADMIN_KEY"):
        monkeypatch.delenv(var, raising=False)
    shape = tmp_path / "shape"
    shape.mkdir()
    (shape / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "out"
    rc = main(["bench", "serve", "--out", str(out), "--no-progress", "--num-requests", "8", "--prompt-len", "8",
               "--output-len", "4", "--tenant-rate", "4", "--mix", "one", "--adapters", "1", "--rank", "8",
               f"model.path={shape}", *SHAPE])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    res = json.loads((out / "serve.json").read_text())
    t = res["tenants"]
    assert t["plan"] == {"rate": 4.0, "flood": 10.0, "burst": 4, "max_concurrent": 32, "requests": 8,
                         "flood_requests": 80, "tenants": {"A": FLOOD, "B": STEADY},
                         "client_processes_per_tenant": 1}
    assert res["rows"] == [] and res["server"]["exit_status"] == 0
    rows = {(r["phase"], r["tenant"]): r for r in t["rows"]}
    assert list(rows) == [("alone", STEADY), ("mixed", FLOOD), ("mixed", STEADY)]
    assert all(r["mix"] == "one" for r in t["rows"])

    # B sends exactly its share in both phases: every request served, in full, no 429.
    for phase in ("alone", "mixed"):
        b = rows[phase, STEADY]
        assert b["offered_rps"] == 4.0 and b["requests"] == b["ok"] == 8 and b["failures"] == {}
        assert b["output_tokens"] == 8 * 4 and b["output_len_mismatch"] == 0
        assert b["ttft_ms"]["p99"] > 0 and b["server"]["rejections"] == {} and b["server"]["admitted"] == 8
    # A offers 10x its share: its excess is refused (429, the tenant's requests/s limit), the rest served.
    a = rows["mixed", FLOOD]
    assert a["offered_rps"] == 40.0 and a["requests"] == 80
    assert set(a["failures"]) == {"429"} and a["ok"] + a["failures"]["429"] == 80
    assert a["ok"] >= 4 and a["failures"]["429"] >= 40  # at least its burst served; most of the flood refused
    assert a["output_tokens"] == a["ok"] * 4
    assert "Request rate limit reached" in a["first_errors"]["429"]
    # The server's own counters say the same: every 429 was A's, by a tenant limit; B was never refused.
    assert sum(a["server"]["rejections"].values()) == a["failures"]["429"]
    assert a["server"]["admitted"] == a["ok"]
    assert a["server_total"]["requests_by_reason"]["error"] == 0
    # The server's step-path counters reach serve.json: on CPU every step runs eagerly.
    steps = a["server_total"]["steps_by_path"]
    assert steps["eager"] > 0 and steps["graph"] == steps["piecewise"] == 0
    assert a["server_total"]["step_tokens_mean_by_path"]["eager"] > 0

    [f] = t["fairness"]
    assert f["mix"] == "one" and f["target"] == 1.5 and f["b_429"] == 0 and f["b_failures"] == 0
    assert f["a_429"] == a["failures"]["429"] and f["a_other_failures"] == 0
    ratio = round(rows["mixed", STEADY]["ttft_ms"]["p99"] / rows["alone", STEADY]["ttft_ms"]["p99"], 3)
    assert f["b_ttft_p99_ratio"] == ratio > 0 and f["met"] == (ratio <= 1.5)
    assert "B p99 TTFT with A flooding / alone" in printed and "| one | mixed | A | 40.0 | 80 |" in printed

    # The tenants file holds environment references only; no generated key is written or shown anywhere.
    written = (out / "tenants-config" / "tenants" / "bench_fair.yaml").read_text()
    assert "${oc.env:APPLIANCE_BENCH_TENANT_A_KEY}" in written and "${oc.env:APPLIANCE_BENCH_TENANT_B_KEY}" in written
    assert len(made) == 4  # the admin key (adapters), the two tenants' keys, the bench's own key
    seen = printed + (out / "serve.json").read_text() + (out / "server.log").read_text() + written
    assert not [k for k in made if k in seen]


def test_tenant_mix_options_and_plan() -> None:
    o = ServeOptions(concurrency=[], tenant_rate=2.5)
    o.check()
    plan = TenantPlan.of(o, max_num_seqs=256)
    assert (plan.burst, plan.max_concurrent, plan.flood_requests, plan.specs_needed) == (4, 128, 640, 768)
    assert TenantPlan.of(ServeOptions(concurrency=[], tenant_rate=16), 64).burst == 16
    assert serve_tenants.even_arrivals(3, 4.0) == [0.0, 0.25, 0.5]
    for bad, words in ((dict(tenant_rate=2.0), "drop --concurrency"),
                       (dict(concurrency=[], tenant_rate=2.0, url="http://h:1"), "cannot use --url"),
                       (dict(concurrency=[], tenant_rate=2.0, tenant_flood=1.0), "--tenant-flood"),
                       (dict(concurrency=[], tenant_rate=-1.0), "--tenant-rate")):
        with pytest.raises(ConfigError, match=words):
            ServeOptions(**bad).check()


def test_tenants_file_composes_into_the_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from appliance.config.compose import compose_config

    plan = TenantPlan.of(ServeOptions(concurrency=[], tenant_rate=3), max_num_seqs=8)
    overrides, env, keys = serve_tenants.server_setup(plan, tmp_path, server_limit=4)
    assert set(env) == set(serve_tenants.KEY_ENVS.values()) and set(keys) == {FLOOD, STEADY}
    assert "server.max_concurrent_requests=24" in overrides  # both shares (4 + 4) and the bench's own
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    cfg = compose_config(None, overrides)
    assert set(cfg.tenants) == {FLOOD, STEADY}
    for name, t in cfg.tenants.items():
        assert t.weight == 1 and t.adapters == ["*"] and t.allow_base
        assert (t.limits.requests_per_s, t.limits.burst, t.limits.max_concurrent) == (3, 4, 4)
        assert t.key_digests() == [hashlib.sha256(keys[name].encode()).hexdigest()]
    assert not any(v in " ".join(overrides) for v in env.values())
