"""The alert rules (docker/prometheus/rules/appliance.yml): promtool accepts them, each alert fires on
its fixture and stays quiet on a healthy replica (`promtool test rules`, tests/docker/alert_rules_test.yml),
and every metric they read is one the appliance exports."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from appliance.config.schema import MetricsConfig
from appliance.telemetry.metrics import BuildInfo, Metrics
from tests.telemetry.helpers import require_tool

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "docker/prometheus/rules/appliance.yml"
FIXTURES = Path(__file__).with_name("alert_rules_test.yml")


def alerts() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]


def test_promtool_checks_the_rules() -> None:
    res = subprocess.run([require_tool("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0 and "SUCCESS: 6 rules found" in res.stdout, res.stdout + res.stderr


def test_every_alert_passes_its_fixture() -> None:
    names = {a["alert"] for a in alerts()}
    assert names == {"ApplianceAdapterSlotThrash", "ApplianceTTFTHigh", "ApplianceConfigReloadFailed",
                     "ApplianceEngineErrors", "ApplianceShedding", "ApplianceKVCacheNearFull"}
    fixtures = yaml.safe_load(FIXTURES.read_text())["tests"]
    tested = {t["alertname"] for f in fixtures for t in f["alert_rule_test"] if t["exp_alerts"]}
    assert tested == names  # each one seen firing, on instance a only (b is the healthy replica)
    res = subprocess.run([require_tool("promtool"), "test", "rules", FIXTURES.name], capture_output=True,
                         text=True, timeout=60, cwd=FIXTURES.parent)
    assert res.returncode == 0 and "SUCCESS" in res.stdout, res.stdout + res.stderr


def test_every_metric_the_rules_read_is_exported() -> None:
    m = Metrics(MetricsConfig(), BuildInfo("0", "m", "torch"), eviction_policy="lru", lora_enabled=True, lora_slots=2)
    exported: set[str] = set()
    for fam in m.registry.collect():
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(fam.type, [""])
        exported |= {fam.name + s for s in suffixes}
    read = {n for a in alerts() for n in re.findall(r"\bappliance_[a-z_]+", a["expr"])}
    assert read and read <= exported, read - exported
