"""`serve` with parallel.tp_size > 1 as a real process (uvicorn, rank 0) with its worker processes.

- The admin API (load, pin, unload) works across ranks and requests answer peft's greedy tokens.
- SIGTERM: drain, every rank exits, status 0.
- A worker killed: the server ends with an error naming the rank, and no rank is left running.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import requests

from tests.conftest import REPO, make_tiny_model
from tests.lora.test_lora_engine import NEW, PROMPTS, make_adapter, peft_greedy
from tests.parallel.test_tp_engine import children
from tests.server.test_shutdown import ServeProcess, free_port

ADMIN = {"Authorization": "Bearer tp-admin"}
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}


class TPServe(ServeProcess):
    """A serve process with parallel.tp_size=`tp`, its output in a log file under `log_dir` (kept for
    asserts), in its own session: a test may signal its whole process group (Ctrl-C)."""

    def __init__(self, model: Path, tp: int, log_dir: Path, *extra: str) -> None:
        self.master_port = free_port()
        self.log = open(log_dir / f"serve-{self.master_port}.log", "w+")
        super().__init__(model, "engine.num_kv_blocks=64", "server.admin_key=tp-admin", f"parallel.tp_size={tp}",
                         f"parallel.master_port={self.master_port}", *extra, out=self.log, new_session=True)

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def wait_healthy(self, timeout_s: float = 300) -> None:
        super().wait_healthy(timeout_s)

    def post(self, path: str, body: dict) -> requests.Response:
        return requests.post(self.url + path, headers=ADMIN, json=body, timeout=120)


@pytest.fixture
def procs() -> Iterator[list[TPServe]]:
    out: list[TPServe] = []
    yield out
    for s in out:
        workers = children(s.proc.pid) if s.proc.poll() is None else []
        for pid in [s.proc.pid, *workers]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        s.proc.wait()
        s.log.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose (its parent has not reaped it yet)
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_tp_killed_worker_ends_the_server_with_a_clear_error(tmp_path: Path, default_model_dir: Path,
                                                             procs: list[TPServe]) -> None:
    model = make_tiny_model(tmp_path / "tiny3", default_model_dir, hidden_size=96, num_attention_heads=6,
                            num_key_value_heads=3, intermediate_size=192)
    srv = TPServe(model, 3, tmp_path)
    procs.append(srv)
    srv.wait_healthy()
    workers = children(srv.proc.pid)
    assert len(workers) == 2
    victim, other = workers
    os.kill(victim, signal.SIGKILL)
    assert srv.proc.wait(60) == 1, srv.output()
    out = srv.output()
    assert f"(pid {victim}) exited (killed by SIGKILL); stopping the server and the other ranks" in out, out
    assert "tensor-parallel worker rank " in out
    deadline = time.monotonic() + 10
    while alive(other) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(other), "a worker outlived the server"


def test_tp_worker_exits_when_the_server_is_killed(tmp_path: Path, tiny_model_dir: Path,
                                                   procs: list[TPServe]) -> None:
    srv = TPServe(tiny_model_dir, 2, tmp_path)
    procs.append(srv)
    srv.wait_healthy()
    (worker,) = children(srv.proc.pid)
    srv.proc.kill()  # SIGKILL: no shutdown code runs in rank 0
    srv.proc.wait()
    deadline = time.monotonic() + 30
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(worker), "the worker outlived rank 0"


def test_tp2_two_nodes_admin_api_and_sigterm(tmp_path: Path, tiny_model_dir: Path, procs: list[TPServe]) -> None:
    """parallel.nnodes=2 on one host: `serve` is node 0 (rank 0 only), `appliance worker
    parallel.node_rank=1` runs rank 1. Admin load (and a refused one), pin and unload act on both
    ranks; answers match peft's; SIGTERM stops both with status 0. (One server for both checks: each
    tensor-parallel server start costs CI several seconds of imports per rank.)"""
    root = tmp_path / "adapters"
    pattern = make_adapter(tiny_model_dir, root / "pattern", seed=3, r=8, lora_alpha=8,
                           target_modules=["k_proj", "o_proj", "gate_proj", "down_proj"])
    from appliance.engine.tokenizer import Tokenizer

    ids = [Tokenizer(tiny_model_dir).encode(p) for p in PROMPTS[:2]]
    want = peft_greedy(tiny_model_dir, pattern, ids)[0]
    base = peft_greedy(tiny_model_dir, None, ids)[0]
    srv = TPServe(tiny_model_dir, 2, tmp_path, "parallel.nnodes=2", "lora.enabled=true", "lora.max_lora_rank=8",
                  "lora.max_loras_per_batch=2", f"lora.adapter_roots=[{root}]", "reconcile.watch=false",
                  "reconcile.resync_s=0")
    procs.append(srv)
    node = subprocess.Popen([sys.executable, "-m", "appliance", "worker", *srv.args, "parallel.node_rank=1"],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        srv.wait_healthy()
        assert children(srv.proc.pid) == []  # node 0 holds rank 0 only
        r = srv.post("/generate", {"input_ids": ids[0], "sampling_params": GREEDY})
        assert r.status_code == 200 and r.json()["output_ids"] == base[0], r.text

        r = srv.post("/load_lora_adapter", {"lora_name": "pattern", "lora_path": str(pattern)})
        assert r.status_code == 200, r.text
        bad = srv.post("/load_lora_adapter", {"lora_name": "nope", "lora_path": str(root / "missing")})
        assert bad.status_code == 400
        r = srv.post("/generate", {"input_ids": ids, "sampling_params": GREEDY, "lora_path": ["pattern", None]})
        assert r.status_code == 200, r.text
        assert [x["output_ids"] for x in r.json()] == [want[0], base[1]]

        assert srv.post("/pin_lora_adapter", {"lora_name": "pattern", "pinned": True}).status_code == 200
        state = requests.get(srv.url + "/v1/adapters", headers=ADMIN, timeout=30).json()
        (a,) = state["data"]
        assert a["name"] == "pattern" and a["pinned"] is True and a["tier"] == "gpu"
        r = srv.post("/generate", {"input_ids": ids[1], "sampling_params": GREEDY, "lora_path": "pattern"})
        assert r.json()["output_ids"] == want[1]

        assert srv.post("/unload_lora_adapter", {"lora_name": "pattern"}).status_code == 200
        r = srv.post("/generate", {"input_ids": ids[0], "sampling_params": GREEDY, "lora_path": "pattern"})
        assert r.status_code == 404

        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(120) == 0, srv.output()
        assert node.wait(60) == 0, node.stdout.read()
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()


def test_tp_ctrl_c_to_the_process_group_drains_and_exits_0(tmp_path: Path, tiny_model_dir: Path,
                                                           procs: list[TPServe]) -> None:
    """Ctrl-C in a terminal sends SIGINT to the server's process group: the workers (own session) do
    not get it and die first; the server drains, stops them, exits 0."""
    srv = TPServe(tiny_model_dir, 2, tmp_path)
    procs.append(srv)
    srv.wait_healthy()
    (worker,) = children(srv.proc.pid)
    os.killpg(srv.proc.pid, signal.SIGINT)
    assert srv.proc.wait(120) == 0, srv.output()
    assert "exited (" not in srv.output()
    assert not alive(worker)
