"""A real Prometheus (Debian's binary, loopback, temp dir, 1 s scrape) scrapes a live server under
adapter traffic; every PromQL expression of the provisioned Grafana dashboard must evaluate there, the
traffic panels with numbers, and every metric the dashboard names must be one the server exports. The
portability checks (datasource and instance variables, aggregation, promtool's parse) need no server."""

from __future__ import annotations

import json
import math
import re
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import requests

from tests.conftest import REPO
from tests.telemetry.helpers import (MODEL, complete, free_port, load, lora_server, make_adapters,
                                   require_tool, scrape)
from tests.server.conftest import ServerThread

DASHBOARD = REPO / "docker/grafana/dashboards/appliance.json"
# What Grafana substitutes before sending a query: the adapter and instance variables' "All" value and
# a rate window of several 1 s scrapes.
VARIABLES = {"$adapter": ".*", "$instance": ".*", "$__rate_interval": "10s", "$__interval": "1s"}
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
METRIC = re.compile(r"\bappliance_[a-z0-9_]+")


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, expr) for every target of every panel."""
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def substitute(expr: str) -> str:
    for k, v in VARIABLES.items():
        expr = expr.replace(k, v)
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[ServerThread]:
    dirs = make_adapters(tmp_path_factory.mktemp("prom-adapters"), tiny_model_dir)
    # Overlap loading with a CPU tier of 2 for the 3 adapters the traffic cycles through (LRU misses
    # every time) and every cold read slowed to 0.3 s: loads are in flight, and requests wait for
    # them, while Prometheus scrapes (the "Adapter loads in flight" panel).
    server = lora_server(tiny_model_dir, next(iter(dirs.values())).parent, "lora.overlap_loading=true",
                         "lora.max_loaded_loras=2", "debug.fault_injection_read_delay_s=0.3")
    for name, path in dirs.items():
        load(server, name, path)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def prometheus(srv: ServerThread, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = require_tool("prometheus")
    d = tmp_path_factory.mktemp("prometheus")
    port = srv.url.rsplit(":", 1)[1]
    (d / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: appliance\n    static_configs: [{{targets: ['127.0.0.1:{port}']}}]\n")
    listen = f"127.0.0.1:{free_port()}"
    log = open(d / "prometheus.log", "w")
    proc = subprocess.Popen([binary, f"--config.file={d / 'prometheus.yml'}", f"--storage.tsdb.path={d / 'data'}",
                             f"--web.listen-address={listen}", "--log.level=warn"], stdout=log, stderr=log)
    url = f"http://{listen}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"prometheus exited {proc.returncode}: {(d / 'prometheus.log').read_text()}")
            try:
                if requests.get(url + "/-/ready", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("prometheus did not become ready in 60 s")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def query(prom: str, expr: str) -> dict:
    r = requests.get(prom + "/api/v1/query", params={"query": expr}, timeout=30)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]


def scraped_samples(prom: str, expr: str) -> float:
    res = query(prom, expr)["result"]
    return float(res[0]["value"][1]) if res else 0.0


@pytest.fixture(scope="module")
def traffic(srv: ServerThread, prometheus: str) -> None:
    """Adapter and base requests while Prometheus scrapes, until it holds 10 s of samples with traffic
    in them (bounded: at most 120 requests and 120 s)."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def drive() -> None:
        names = ["qv4", "mlp6", "down2", MODEL]
        try:
            for i in range(120):
                if stop.is_set():
                    return
                complete(srv, names[i % len(names)], max_tokens=4)
                if i % 8 == 0:  # an unknown model: a 404 for the "HTTP errors by code" panel
                    r = requests.post(srv.url + "/v1/completions", timeout=30,
                                      json={"model": "no-such-adapter", "prompt": "x", "max_tokens": 1})
                    assert r.status_code == 404, r.text
        except BaseException as e:  # noqa: BLE001 - reported by the test below
            errors.append(e)

    threads = [threading.Thread(target=drive, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            n = scraped_samples(prometheus, "count_over_time(appliance_generation_tokens_total[1m])")
            grew = scraped_samples(prometheus, "increase(appliance_generation_tokens_total[1m])")
            if n >= 10 and grew > 0 and not errors:
                break
            time.sleep(1)
        else:
            pytest.fail("Prometheus did not collect 10 scrapes with traffic in 120 s")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    assert not errors, errors


def test_prometheus_scrapes_the_server(prometheus: str, traffic: None) -> None:
    up = query(prometheus, 'up{job="appliance"}')["result"]
    assert up and up[0]["value"][1] == "1"
    # The adapter variable's query finds the adapters that had traffic, and only label values we made.
    r = requests.get(prometheus + "/api/v1/label/adapter/values", timeout=30,
                     params={"match[]": "appliance_time_to_first_token_seconds_count"})
    assert {"base", "qv4", "mlp6", "down2"} <= set(r.json()["data"]) <= {"base", "qv4", "mlp6", "down2", "other"}


def test_every_dashboard_expression_evaluates(prometheus: str, traffic: None) -> None:
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    empty, numbers = [], set()
    for title, expr in exprs:
        data = query(prometheus, substitute(expr))
        values = [float(s["value"][1]) for s in data["result"]]
        if not values:
            empty.append((title, expr))
        if any(not math.isnan(v) and v > 0 for v in values):
            numbers.add(title)
    # Every series the dashboard reads is initialised at start, so every expression has data.
    assert not empty, empty
    must_have_numbers = {"GPU LoRA slots", "Adapters by tier", "Evictions per second", "Loads per second",
                         "Load latency p50 / p99", "Time to first token p50", "Time to first token p99",
                         "Inter-token latency p50 / p99", "End-to-end latency p50 / p99",
                         "Tokens per second", "Requests per second", "Last config reload",
                         "Config generation", "Since last successful reload", "Build",
                         "HTTP errors by code", "Adapter residency"}
    assert must_have_numbers <= numbers, must_have_numbers - numbers


def test_loads_in_flight_panel_sees_the_background_reads(prometheus: str, traffic: None) -> None:
    panel = [e for t, e in dashboard_exprs() if t == "Adapter loads in flight"]
    assert panel == ['sum by (tier) (appliance_lora_loads_in_flight{instance=~"$instance"})',
                     'sum(appliance_requests_waiting{reason="load", instance=~"$instance"})']
    # Both gauges were above 0 in some scrape during the traffic (an instant query may fall between reads).
    assert scraped_samples(prometheus, 'max_over_time(appliance_lora_loads_in_flight{tier="cpu"}[5m])') >= 1
    assert scraped_samples(prometheus, 'max_over_time(appliance_requests_waiting{reason="load"}[5m])') >= 1


def test_every_metric_the_dashboard_names_is_exported(srv: ServerThread) -> None:
    text = DASHBOARD.read_text()
    named = set(METRIC.findall(text))
    exported = {name for name, _ in scrape(srv).samples}
    assert named and named <= exported, named - exported


def test_every_panel_has_a_unit_a_description_and_the_datasource_variable() -> None:
    import yaml

    dash = json.loads(DASHBOARD.read_text())
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    for p in panels:
        assert p["description"].strip(), p["title"]
        assert p["fieldConfig"]["defaults"]["unit"], p["title"]
        assert p["datasource"] == DATASOURCE, p["title"]
        assert all(t["datasource"] == DATASOURCE for t in p["targets"]), p["title"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert list(variables) == ["datasource", "instance", "adapter"]
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    for name in ("instance", "adapter"):
        v = variables[name]
        assert v["datasource"] == DATASOURCE and v["includeAll"] and v["multi"] and v["allValue"] == ".*"
    assert variables["instance"]["query"]["query"] == "label_values(appliance_build_info, instance)"
    # In the compose stack the variable resolves to the provisioned Prometheus, the default datasource.
    prov = yaml.safe_load((REPO / "docker/grafana/provisioning/datasources/prometheus.yaml").read_text())
    assert prov["datasources"][0]["isDefault"] is True
    # The per-adapter latency panels follow the variable.
    ttft = [p for p in panels if p["title"].startswith("Time to first token")]
    assert len(ttft) == 2 and all('adapter=~"$adapter"' in p["targets"][0]["expr"] for p in ttft)
    rows = [p["title"] for p in dash["panels"] if p["type"] == "row"]
    assert rows == ["LoRA slots and tiers", "Latency per adapter", "Engine", "Config and reconcile",
                    "HTTP and adapter residency"]


def test_the_dashboard_imports_anywhere() -> None:
    """What kube-prometheus-stack's Grafana (or "Import dashboard") takes as is: no __inputs to fill, no
    database id, no uid of one particular datasource."""
    text = DASHBOARD.read_text()
    dash = json.loads(text)
    assert "__inputs" not in dash and "__requires" not in dash and "id" not in dash
    assert "appliance-prometheus" not in text
    uids = {m for m in re.findall(r'"uid": "([^"]*)"', text)} - {dash["uid"]}
    assert uids == {"${datasource}"}, uids


def test_every_selector_has_the_instance_matcher_and_is_aggregated() -> None:
    exprs = dashboard_exprs()
    for title, expr in exprs:
        selectors = re.findall(r"\bappliance_[a-z0-9_]+(\{[^}]*\})?", expr)
        assert selectors, (title, expr)
        assert all('instance=~"$instance"' in sel for sel in selectors), (title, expr)
        # One series per label set over all selected replicas: an aggregation (or a quantile of summed
        # buckets) is outermost.
        assert re.match(r"\(?(time\(\) - )?(sum|avg|min|max)\b|histogram_quantile\([0-9.]+, sum by \(le\b",
                        expr), (title, expr)


def test_every_dashboard_expression_parses_with_promtool(tmp_path: Path) -> None:
    import yaml

    rules = [{"record": f"dashboard:expr_{i}", "expr": substitute(e)} for i, (_, e) in enumerate(dashboard_exprs())]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    res = subprocess.run([require_tool("promtool"), "check", "rules", str(path)], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"{len(rules)} rules found" in res.stdout, res.stdout


def test_latency_thresholds_are_the_alerts_slo() -> None:
    import yaml

    groups = yaml.safe_load((REPO / "docker/prometheus/rules/appliance.yml").read_text())["groups"]
    rule = next(r for g in groups for r in g["rules"] if r.get("alert") == "ApplianceTTFTHigh")
    slo = float(re.search(r">\s*([0-9.]+)\s*$", rule["expr"].strip()).group(1))
    dash = json.loads(DASHBOARD.read_text())
    by_title = {p["title"]: p for p in dash["panels"]}
    for title in ("Time to first token p50", "Time to first token p99", "Queue time p50 / p99",
                  "Slot wait p50 / p99"):
        steps = by_title[title]["fieldConfig"]["defaults"]["thresholds"]["steps"]
        assert steps[-1] == {"color": "red", "value": slo}, title
