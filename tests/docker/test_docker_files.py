"""The Dockerfile, compose stack and Prometheus config, checked without a Docker engine (none runs
here): linted (hadolint), validated by the compose client and promtool, and the image's entrypoint,
healthcheck and stop signal exercised as plain processes on this machine."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import yaml

from tests.conftest import REPO, config_tree
from tests.telemetry.helpers import free_port, require_tool

DOCKERFILE = REPO / "Dockerfile"
COMPOSE = REPO / "docker/compose.yaml"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        pending += " " + stripped[:-1] if stripped.endswith("\\") else " " + stripped
        if not stripped.endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    return out


def one(name: str) -> str:
    found = [args for word, args in instructions() if word == name]
    assert len(found) == 1, f"{name}: {found}"
    return found[0]


def image_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for word, args in instructions():
        if word == "ENV":
            for item in shlex.split(args):
                k, _, v = item.partition("=")
                env[k] = v
    return env


def tool(name: str) -> str:
    beside = Path(sys.executable).parent / name  # pip-installed tools live beside the interpreter
    return str(beside) if beside.is_file() else require_tool(name)


def test_hadolint_finds_nothing() -> None:
    res = subprocess.run([tool("hadolint"), "--no-color", str(DOCKERFILE)], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def test_dockerfile_contract() -> None:
    assert json.loads(one("ENTRYPOINT")) == ["appliance"]
    assert json.loads(one("CMD")) == ["serve", "--config-dir", "/etc/appliance"]
    assert one("STOPSIGNAL") == "SIGTERM"
    health = one("HEALTHCHECK")
    period = health.split("--start-period=")[1].split()[0]
    assert period.endswith("m") and int(period[:-1]) >= 5, health  # model loads take minutes
    user = one("USER")
    uid, _, gid = user.partition(":")
    assert uid not in ("0", "root") and gid == "0", user
    assert "--gid 0" in " ".join(a for w, a in instructions() if w == "RUN")
    volumes = json.loads(one("VOLUME"))
    assert "/srv/adapters" in volumes
    # GPU base by default, a build arg for a CPU-only base.
    base = [a for w, a in instructions() if w == "ARG" and a.startswith("BASE_IMAGE=")]
    assert base and "nvidia/cuda" in base[0] and "runtime" in base[0]
    assert one("FROM") == "${BASE_IMAGE}"
    env = image_env()
    assert env["APPLIANCE_HOST"] == "0.0.0.0" and env["APPLIANCE_PORT"] == "8000"
    # Triton's compiled kernels on the cache volume: a new container loads them instead of compiling
    # again at start (an H200's warm-up: ~15 s compiling, 3.5 s from the disk cache).
    assert env["TRITON_CACHE_DIR"].startswith(env["APPLIANCE_CACHE_DIR"] + "/")
    assert env["APPLIANCE_CACHE_DIR"] in volumes


def test_dockerignore_keeps_every_copied_path() -> None:
    kept = {line[1:].rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines()
            if line.startswith("!")}
    for word, args in instructions():
        if word == "COPY":
            *sources, _ = shlex.split(args)
            for src in sources:
                assert src.rstrip("/") in kept, f"COPY {src} is excluded by .dockerignore"
                assert (REPO / src).exists(), src


def compose_command() -> list[str]:
    """`docker compose` when the plugin is there, else the standalone docker-compose client; both
    validate and print the file without a Docker engine."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return [require_tool("docker-compose")]


def test_compose_file_validates_and_wires_the_stack() -> None:
    res = subprocess.run([*compose_command(), "-f", str(COMPOSE), "config"], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert res.returncode == 0, res.stderr
    cfg = yaml.safe_load(res.stdout)
    svc = cfg["services"]
    assert set(svc) == {"model-prepare", "appliance", "appliance-cpu", "prometheus", "grafana"}
    # Profiles: gpu reserves the devices, cpu runs anywhere under the name Prometheus scrapes; the
    # rest of the stack belongs to no profile, so it starts with either.
    cpu, app = svc["appliance-cpu"], svc["appliance"]
    assert app["profiles"] == ["gpu"] and cpu["profiles"] == ["cpu"] and "deploy" not in cpu
    assert cpu["networks"]["default"]["aliases"] == ["appliance"]
    assert cpu["volumes"] == app["volumes"] and cpu["depends_on"] == app["depends_on"]
    assert not any("profiles" in svc[n] or "appliance" in svc[n].get("depends_on", {})
                   for n in ("model-prepare", "prometheus", "grafana"))
    vols = {v.split(":")[1] if isinstance(v, str) else v["target"]: v for v in app["volumes"]}
    conf = vols["/etc/appliance"]
    # The whole configs dir, read-only (a directory mount, so hot reload sees saved files).
    src = conf.split(":")[0] if isinstance(conf, str) else conf["source"]
    ro = conf.endswith(":ro") if isinstance(conf, str) else conf.get("read_only")
    assert Path(src) == REPO / "configs" and ro, conf
    assert "/srv/adapters" in vols
    devices = app["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert app["depends_on"]["model-prepare"]["condition"] == "service_completed_successfully"
    prom_mounts = " ".join(str(v) for v in svc["prometheus"]["volumes"])
    assert "docker/prometheus/prometheus.yml" in prom_mounts
    graf_mounts = " ".join(str(v) for v in svc["grafana"]["volumes"])
    assert "docker/grafana/provisioning" in graf_mounts and "docker/grafana/dashboards" in graf_mounts


def test_prometheus_config_is_valid_and_scrapes_the_appliance() -> None:
    path = REPO / "docker/prometheus/prometheus.yml"
    res = subprocess.run([require_tool("promtool"), "check", "config", str(path)], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    job = yaml.safe_load(path.read_text())["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"] == ["appliance:8000"]
    dash_path = yaml.safe_load((REPO / "docker/grafana/provisioning/dashboards/appliance.yaml").read_text())[
        "providers"][0]["options"]["path"]
    compose = yaml.safe_load(COMPOSE.read_text())
    assert any(v.endswith(f":{dash_path}:ro") for v in compose["services"]["grafana"]["volumes"])


def test_image_entrypoint_serves_answers_healthcheck_and_stops_on_its_signal(tmp_path: Path,
                                                                            tiny_model_dir: Path) -> None:
    """ENTRYPOINT + CMD as the image runs them, with /etc/appliance a copy of configs/ (the tiny model
    set in it, as an operator edits their mounted dir), the image's ENV, and loopback instead of 0.0.0.0."""
    conf = config_tree(tmp_path / "etc-appliance", f"model:\n  path: {tiny_model_dir}\n  name: tiny\n"
                                                     "  device: cpu\n  max_model_len: 512\n")
    argv = json.loads(one("ENTRYPOINT")) + json.loads(one("CMD"))
    argv = [str(conf) if a == "/etc/appliance" else a for a in argv]
    assert argv[0] == "appliance"
    port = free_port()
    env = {**os.environ, **image_env(), "APPLIANCE_HOST": "127.0.0.1", "APPLIANCE_PORT": str(port),
           "APPLIANCE_CACHE_DIR": str(tmp_path / "cache"), "HOME": str(tmp_path), "PATH": os.environ["PATH"]}
    # `appliance` is this checkout's console script; run it as `python -m appliance` from the repo root
    # so the code under test is this tree's.
    cmd = [sys.executable, "-m", "appliance", *argv[1:]]
    health_argv = json.loads(one("HEALTHCHECK").split(" CMD ", 1)[1])
    copied = {dst: src for w, a in instructions() if w == "COPY" for src, dst in [shlex.split(a)[-2:]]}
    health = [sys.executable if a == "python3" else str(REPO / copied[a]) if a in copied else a
              for a in health_argv]

    def healthy() -> bool:
        return subprocess.run(health, env=env, capture_output=True, timeout=30).returncode == 0

    assert not healthy()  # nothing listens yet
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not healthy():
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the healthcheck never passed"
            time.sleep(0.5)
        r = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=30)
        assert r.status_code == 200 and 'appliance_build_info{' in r.text and 'model="tiny"' in r.text
        proc.send_signal(getattr(signal, one("STOPSIGNAL")))
        out = proc.communicate(timeout=60)[0]
        assert proc.returncode == 0, out
        assert not healthy()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
