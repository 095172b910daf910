"""Rank 0's side of tensor parallelism: start the worker processes, watch them, stop them.

`start_ranks` (called by LLMEngine when parallel.tp_size > 1) checks that tp_size divides the model
before anything starts, spawns ranks 1..tp_size-1 as `python -m appliance.parallel.worker` processes on
this host (cuda:r each, or the CPU with gloo), and joins the process group as rank 0; the server
process stays rank 0 and runs the scheduler, the LoRA manager and HTTP.

Failure is loud and total: a worker that exits while the engine runs (killed, crashed, out of memory)
leaves rank 0's collectives waiting for ever, so a watcher thread ends the server process at once
with an error naming the rank, after killing the other workers. Workers exit by themselves when rank 0
is gone (worker.py). `stop` (engine shutdown, SIGTERM's drain) sends Stop and waits for them.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import appliance
from appliance.config.schema import ApplianceConfig
from appliance.models.llama import ModelArgs
from appliance.models.weights import read_hf_config
from appliance.parallel.group import TPGroup, init_group, rank_device
from appliance.parallel.layout import TPLayout
from appliance.parallel.messages import RunStep, Stop

log = logging.getLogger(__name__)

_STOP_WAIT_S = 30.0  # a worker answering Stop only closes its process group
_KILL_WAIT_S = 5.0


class Workers:
    """The worker processes of ranks 1..tp_size-1 and the thread that watches them."""

    def __init__(self, cfg: ApplianceConfig) -> None:
        self.size = cfg.parallel.tp_size
        self._stopping = threading.Event()
        # The workers import the same appliance package as this process, wherever it lives.
        src = str(Path(appliance.__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}
        self.procs: list[subprocess.Popen] = []
        try:
            for rank in range(1, self.size):
                p = subprocess.Popen([sys.executable, "-m", "appliance.parallel.worker"], stdin=subprocess.PIPE,
                                     env=env)
                assert p.stdin is not None
                p.stdin.write(pickle.dumps((cfg, rank)))
                p.stdin.close()
                self.procs.append(p)
        except BaseException:
            self.kill()
            raise
        log.info("started tensor-parallel workers: %s",
                 ", ".join(f"rank {r} pid {p.pid}" for r, p in enumerate(self.procs, 1)))
        self._watcher = threading.Thread(target=self._watch, name="tp-watch", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        while not self._stopping.wait(0.2):
            for rank, p in enumerate(self.procs, 1):
                code = p.poll()
                if code is not None and not self._stopping.is_set():
                    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
                    self.fail(f"tensor-parallel worker rank {rank} (pid {p.pid}) exited ({how})")

    def fail(self, reason: str) -> NoReturn:
        """End the server process now: rank 0 cannot serve without every rank."""
        self._stopping.set()
        msg = f"appliance: {reason}; stopping the server and the other ranks"
        log.critical(msg)
        print(msg, file=sys.stderr, flush=True)  # also when logging is not set up (embedding, tests)
        self.kill()
        os._exit(1)

    def stop(self, group: TPGroup) -> None:
        """Graceful: every worker leaves its loop and exits; any left after _STOP_WAIT_S is killed."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        group.broadcast(Stop())
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

    def stop(self) -> None:
        self.workers.stop(self.group)
        self.group.destroy()

    def kill(self) -> None:
        self.workers.kill()
        self.group.destroy()


def start_ranks(cfg: ApplianceConfig, model_path: str) -> TPLeader:
    """Check the layout against the model, start ranks 1.., join the group as rank 0."""
    args = ModelArgs.from_hf_config(read_hf_config(model_path))
    TPLayout.check(args, cfg.parallel.tp_size)  # refused before any process starts
    device = rank_device(cfg.model.device, 0)
    workers = Workers(cfg)
    try:
        group = init_group(cfg.parallel, 0, device)
    except BaseException:
        workers.kill()
        raise
    group.on_failure = workers.fail
    return TPLeader(group, workers, TPLayout(args, 0, cfg.parallel.tp_size))
