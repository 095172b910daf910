"""The Kubernetes manifests (docker/k8s): both overlays render (tests/docker/kustomize_lite.py, as
`kubectl kustomize` would), every built-in object validates against the Kubernetes schemas of two
versions (kubernetes-validate), the Prometheus Operator objects (CRDs, no schema there) are checked for
their required fields, and the pieces agree with each other, the image and the server: probes on real
routes, the Dockerfile's user, the rule file, a ConfigMap that composes over the packaged configs,
and the cpu overlay's pod run as processes."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import kubernetes_validate
import openai
import pytest
import requests
import yaml

from appliance.config.compose import compose_config, compose_tree
from appliance.server.probes import Probes
from tests.conftest import REPO
from tests.docker.test_docker_files import image_env
from tests.docker.kustomize_lite import merge, render
from tests.telemetry.helpers import free_port

K8S = REPO / "docker/k8s"
OVERLAYS = ["cpu", "gpu"]
# The oldest and newest schemas kubernetes-validate ships that these manifests target.
VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]
CRDS = {"ServiceMonitor", "PrometheusRule"}


def objects(overlay: str) -> list[dict[str, Any]]:
    return render(K8S / "overlays" / overlay)


def one(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [o for o in objs if o["kind"] == kind]
    return found


def pod(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objs, "Deployment")["spec"]["template"]["spec"]


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("version", VERSIONS)
def test_every_builtin_object_validates(overlay: str, version: str) -> None:
    objs = objects(overlay)
    assert {o["kind"] for o in objs} == {"ConfigMap", "Secret", "PersistentVolumeClaim", "Deployment", "Service",
                                         "PodDisruptionBudget"} | CRDS
    for o in objs:
        if o["kind"] not in CRDS:
            # strict: an unknown (misspelt) field is an error too.
            kubernetes_validate.validate(o, version, strict=True)


def test_the_validator_catches_a_bad_manifest() -> None:
    dep = one(objects("cpu"), "Deployment")
    bad = merge(dep, {"spec": {"template": {"spec": {"containers": [{"name": "appliance", "livenessProbe": {
        "httpGet": {"paht": "/health"}}}]}}}})
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSIONS[-1], strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_operator_objects_have_their_required_fields(overlay: str) -> None:
    objs = objects(overlay)
    sm, rule = one(objs, "ServiceMonitor"), one(objs, "PrometheusRule")
    for o in (sm, rule):
        assert o["apiVersion"] == "monitoring.coreos.com/v1" and o["metadata"]["name"]
    svc = one(objs, "Service")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    ports = {p["name"] for p in svc["spec"]["ports"]}
    assert sm["spec"]["endpoints"] and all(e["port"] in ports and e["path"] == "/metrics"
                                           for e in sm["spec"]["endpoints"])
    for group in rule["spec"]["groups"]:
        assert group["name"] and group["rules"]
        assert all(r["expr"] and ("alert" in r) != ("record" in r) for r in group["rules"])


def test_the_prometheus_rule_carries_the_rule_file() -> None:
    rules = yaml.safe_load((REPO / "docker/prometheus/rules/appliance.yml").read_text())
    assert one(objects("cpu"), "PrometheusRule")["spec"] == rules


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_pieces_agree(overlay: str) -> None:
    objs = objects(overlay)
    dep, svc, pdb = one(objs, "Deployment"), one(objs, "Service"), one(objs, "PodDisruptionBudget")
    spec = pod(objs)
    labels = dep["spec"]["template"]["metadata"]["labels"]
    for selector in (dep["spec"]["selector"]["matchLabels"], pdb["spec"]["selector"]["matchLabels"],
                     svc["spec"]["selector"]):
        assert selector.items() <= labels.items()
    (server,) = spec["containers"]
    assert {p["name"]: p["containerPort"] for p in server["ports"]} == {"http": 8000}
    # Probes on the server's own routes, open (no key), through the named port.
    routes = {r.path for r in Probes.__new__(Probes).routes()}  # the paths only: no engine needed
    probes = {k: server[k]["httpGet"] for k in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert {k: p["path"] for k, p in probes.items()} == {
        "startupProbe": "/health", "readinessProbe": "/ready", "livenessProbe": "/health_generate"}
    assert {p["path"] for p in probes.values()} <= routes and {p["port"] for p in probes.values()} == {"http"}
    # The startup probe covers the Dockerfile's start-period; liveness waits longer than its own generation.
    start = server["startupProbe"]
    dockerfile = (REPO / "Dockerfile").read_text()
    period = int(re.search(r"--start-period=(\d+)m", dockerfile).group(1)) * 60
    assert start["periodSeconds"] * start["failureThreshold"] >= period
    cfg = compose_config(None)
    assert server["livenessProbe"]["timeoutSeconds"] > cfg.server.health_generate_timeout_s
    assert spec["terminationGracePeriodSeconds"] > cfg.server.shutdown_timeout_s
    # The image's user, and a read-only root with every path the server writes on a volume.
    uid, gid = re.search(r"^USER (\d+):(\d+)$", dockerfile, re.M).groups()
    assert (spec["securityContext"]["runAsUser"], spec["securityContext"]["runAsGroup"]) == (int(uid), int(gid))
    volumes = {v["name"] for v in spec["volumes"]}
    for c in spec["initContainers"] + spec["containers"]:
        assert c["securityContext"]["readOnlyRootFilesystem"] and not c["securityContext"]["allowPrivilegeEscalation"]
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert {m["name"] for m in mounts.values()} <= volumes
        writable = {p for p, m in mounts.items() if not m.get("readOnly")}
        assert {"/var/cache/appliance", "/home/appliance", "/tmp"} <= writable
        # A subPath mount receives no ConfigMap updates: the config is a directory mount.
        assert "subPath" not in mounts["/etc/appliance"] and mounts["/etc/appliance"]["readOnly"]
    # Keys come from the Secret the base ships.
    secret = one(objs, "Secret")
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in server["env"]}
    assert refs.keys() == {"APPLIANCE_ADMIN_KEY", "APPLIANCE_API_KEY"}
    assert all(r["name"] == secret["metadata"]["name"] and r["key"] in secret["stringData"] for r in refs.values())
    pvc = one(objs, "PersistentVolumeClaim")
    assert {"persistentVolumeClaim": {"claimName": pvc["metadata"]["name"]}}.items() <= \
        next(v for v in spec["volumes"] if v["name"] == "cache").items()


def test_the_gpu_overlay_asks_for_a_gpu_and_the_gpu_groups() -> None:
    (server,) = pod(objects("gpu"))["containers"]
    assert server["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert {"engine=gpu", "lora=gpu"} <= set(server["args"])
    (cpu_server,) = pod(objects("cpu"))["containers"]
    assert "nvidia.com/gpu" not in str(cpu_server["resources"])


def write_configmap(objs: list[dict[str, Any]], dest: Path) -> Path:
    """The config volume as the kubelet lays it out: each ConfigMap key at its item's path."""
    cm = one(objs, "ConfigMap")
    (vol,) = [v for v in pod(objs)["volumes"] if v["name"] == "config"]
    assert vol["configMap"]["name"] == cm["metadata"]["name"]
    assert {i["key"] for i in vol["configMap"]["items"]} == cm["data"].keys()  # no key left unmounted
    for item in vol["configMap"]["items"]:
        (dest / item["path"]).parent.mkdir(parents=True, exist_ok=True)
        (dest / item["path"]).write_text(cm["data"][item["key"]])
    return dest


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_configmap_composes_over_the_packaged_configs(overlay: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    objs = objects(overlay)
    cdir = write_configmap(objs, tmp_path)
    secret = one(objs, "Secret")["stringData"]
    monkeypatch.setenv("APPLIANCE_API_KEY", secret["api-key"])
    monkeypatch.setenv("APPLIANCE_ADMIN_KEY", secret["admin-key"])
    spec = pod(objs)
    for c in spec["initContainers"] + spec["containers"]:
        args = c["args"]
        at = args.index("--config-dir")
        assert args[at + 1] == next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "config")
        cfg = compose_tree(cdir, args[at + 2:]).cfg
        packaged = compose_config(None, args[at + 2:])
        assert cfg.server.api_keys == [secret["api-key"]] and cfg.server.admin_key == secret["admin-key"]
        assert cfg.metrics.gateway_compat and cfg.logging.format == "json"
        assert cfg.engine == packaged.engine and cfg.lora == packaged.lora and cfg.model == packaged.model
        gpu_groups = compose_config(None, ["engine=gpu", "lora=gpu"])
        assert (cfg.engine == gpu_groups.engine) == (overlay == "gpu"), shlex.join(args)


def test_the_cpu_overlay_pod_serves_as_deployed(tmp_path: Path, default_model_dir: Path) -> None:
    """The init container's and the server's args as plain processes (this checkout's code), with the
    ConfigMap laid out as the kubelet mounts it, the Secret's keys in the environment, the image's ENV
    and loopback instead of 0.0.0.0; then each probe as the kubelet calls it, and the API key at work."""
    objs = objects("cpu")
    conf = write_configmap(objs, tmp_path / "etc-appliance")
    spec = pod(objs)
    (init,), (server,) = spec["initContainers"], spec["containers"]
    secret = one(objs, "Secret")["stringData"]
    port = free_port()
    env = {**os.environ, **image_env(), "APPLIANCE_HOST": "127.0.0.1", "APPLIANCE_PORT": str(port),
           # The cache volume already holds the converted model, as after a first start.
           "APPLIANCE_CACHE_DIR": str(default_model_dir.parent.parent), "TRITON_CACHE_DIR": str(tmp_path / "triton"),
           "HOME": str(tmp_path)}
    env.update({e["name"]: secret[e["valueFrom"]["secretKeyRef"]["key"]] for e in server["env"]})

    def argv(c: dict[str, Any]) -> list[str]:
        return [sys.executable, "-m", "appliance", *[str(conf) if a == "/etc/appliance" else a for a in c["args"]]]

    prep = subprocess.run(argv(init), cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert prep.returncode == 0 and prep.stdout.strip() == str(default_model_dir), prep.stdout + prep.stderr
    proc = subprocess.Popen(argv(server), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    base = f"http://127.0.0.1:{port}"

    def probe(name: str) -> int:
        p = server[name]
        try:
            return requests.get(base + p["httpGet"]["path"], timeout=p["timeoutSeconds"]).status_code
        except requests.ConnectionError:
            return 0

    try:
        start = server["startupProbe"]
        deadline = time.monotonic() + start["periodSeconds"] * start["failureThreshold"]
        while probe("startupProbe") != 200:
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the startup probe never passed"
            time.sleep(0.5)
        assert probe("readinessProbe") == 200 and probe("livenessProbe") == 200
        # Inference needs the Secret's api-key; the open probes and /metrics do not.
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="wrong").models.list()
        models = openai.OpenAI(base_url=base + "/v1", api_key=secret["api-key"]).models.list()
        assert "SmolLM2-135M-Instruct" in {m.id for m in models}
        assert "vllm:num_requests_waiting" in requests.get(base + "/metrics", timeout=30).text  # gateway_compat
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=spec["terminationGracePeriodSeconds"])[0]
        assert proc.returncode == 0, out
        # logging.format: json from the ConfigMap: the per-request lines parse.
        logged = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert any("/v1/models" in json.dumps(rec) for rec in logged), out[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
