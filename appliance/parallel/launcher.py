"""Rank 0's side of tensor parallelism: start the worker processes, watch them, stop them.

`start_ranks` checks that tp_size divides the model before anything starts, spawns this host's other
ranks as `python -m appliance.parallel.worker` and joins as rank 0 (scheduler, LoRA manager, HTTP);
other hosts run `run_node` via `appliance worker`. Failure is total: a worker that dies would leave
rank 0's collectives waiting for ever, so a watcher kills the other workers and ends the server with
an error naming the rank.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import appliance
from appliance.config.compose import config_to_dict
from appliance.config.schema import ApplianceConfig, ConfigError
from appliance.models.llama import ModelArgs
from appliance.models.weights import read_hf_config
from appliance.parallel.group import TPGroup, init_group, rank_device
from appliance.parallel.layout import TPLayout
from appliance.parallel.messages import RunStep, SetupDecode, Stop

log = logging.getLogger(__name__)

_STOP_WAIT_S = 30.0  # a worker answering Stop only closes its process group
_KILL_WAIT_S = 5.0


class Workers:
    """Worker processes of `ranks` and the thread that watches them. A worker that exits ends this
    process (after the others are killed), except an exit 0 when `clean_exit_ok` (a node of a
    multi-host layout: its workers exit 0 when rank 0 sends Stop)."""

    def __init__(self, cfg: ApplianceConfig, ranks: range, clean_exit_ok: bool = False) -> None:
        self.ranks = ranks
        self.clean_exit_ok = clean_exit_ok
        self._stopping = threading.Event()
        # The workers import the same appliance package as this process, wherever it lives.
        src = str(Path(appliance.__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}
        self.procs: list[subprocess.Popen] = []
        try:
            for rank in ranks:
                # Own session: Ctrl-C in a terminal reaches the server (which drains, then stops the
                # ranks), not the workers, which would die first and end the server with an error.
                p = subprocess.Popen([sys.executable, "-m", "appliance.parallel.worker"], stdin=subprocess.PIPE,
                                     env=env, start_new_session=True)
                assert p.stdin is not None
                # JSON, not pickle: nothing the appliance reads is ever unpickled (docs/reliability.md).
                p.stdin.write(json.dumps({"rank": rank, "config": config_to_dict(cfg)}).encode())
                p.stdin.close()
                self.procs.append(p)
        except BaseException:
            self.kill()
            raise
        log.info("started tensor-parallel workers: %s",
                 ", ".join(f"rank {r} pid {p.pid}" for r, p in zip(ranks, self.procs)))
        self._watcher = threading.Thread(target=self._watch, name="tp-watch", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        while not self._stopping.wait(0.2):
            for rank, p in zip(self.ranks, self.procs):
                code = p.poll()
                if code is not None and not self._stopping.is_set() and not (code == 0 and self.clean_exit_ok):
                    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
                    self.fail(f"tensor-parallel worker rank {rank} (pid {p.pid}) exited ({how})")

    def fail(self, reason: str) -> NoReturn:
        """End the server process now: rank 0 cannot serve without every rank."""
        self._stopping.set()
        msg = f"appliance: {reason}; stopping the server and the other ranks"
        log.critical(msg)
        if not logging.getLogger().hasHandlers():
            print(msg, file=sys.stderr, flush=True)  # logging not set up (embedding, tests): still say why
        self.kill()
        os._exit(1)

    def stop(self, group: TPGroup) -> None:
        """Graceful: every worker leaves its loop and exits; any left after _STOP_WAIT_S is killed."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        group.broadcast(Stop())
        group.quiesce()  # every rank, this host's and other hosts', at teardown together (CPU)
        for p in self.procs:
            try:
                p.wait(timeout=_STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel worker pid %d did not stop; killing it", p.pid)
        self.kill()

    def kill(self) -> None:
        """SIGTERM each worker still running, then SIGKILL after _KILL_WAIT_S; reaps them all."""
        self._stopping.set()
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=_KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@dataclass
class TPLeader:
    """Rank 0's group and workers, owned by the LLMEngine."""

    group: TPGroup
    workers: Workers
    layout: TPLayout

    def broadcast_step(self, batch: object) -> None:
        self.group.broadcast(RunStep(batch))  # type: ignore[arg-type]

    def setup_decode(self, sizes: list[int], capture: bool) -> None:
        self.group.broadcast(SetupDecode(list(sizes), capture))

    def stop(self) -> None:
        self.workers.stop(self.group)
        self.group.destroy()

    def kill(self) -> None:
        self.workers.kill()
        self.group.destroy()


def start_ranks(cfg: ApplianceConfig, model_path: str) -> TPLeader:
    """Check the layout against the model, start this host's ranks 1.., join the group as rank 0."""
    p = cfg.parallel
    if p.node_rank != 0:
        raise ConfigError(f"parallel.node_rank: {p.node_rank}: `appliance serve` runs rank 0 on node 0; "
                          "start the other nodes with `appliance worker parallel.node_rank=K`")
    args = ModelArgs.from_hf_config(read_hf_config(model_path))
    TPLayout.check(args, p.tp_size)  # refused before any process starts
    device = rank_device(cfg.model.device, 0)
    workers = Workers(cfg, range(1, p.ranks_per_node))
    try:
        group = init_group(cfg.parallel, 0, device)
    except BaseException:
        workers.kill()
        raise
    group.on_failure = workers.fail
    return TPLeader(group, workers, TPLayout(args, 0, cfg.parallel.tp_size))


def run_node(cfg: ApplianceConfig) -> int:
    """`appliance worker`: run node parallel.node_rank's ranks until they exit (0 once rank 0 stopped
    them; a failing rank ends the node with 1 after killing its other ranks)."""
    p = cfg.parallel
    if p.node_rank == 0:
        raise ConfigError("parallel.node_rank: 0 is the server's node (`appliance serve`); a worker node "
                          f"has node_rank 1..{p.nnodes - 1} (parallel.nnodes={p.nnodes})")
    TPLayout.check(ModelArgs.from_hf_config(read_hf_config(Path(cfg.model.path).expanduser())), p.tp_size)
    first = p.node_rank * p.ranks_per_node
    workers = Workers(cfg, range(first, first + p.ranks_per_node), clean_exit_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: (workers.kill(), os._exit(0)))
    for proc in workers.procs:
        proc.wait()
    workers.kill()
    return 0
