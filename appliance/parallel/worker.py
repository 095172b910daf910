"""A tensor-parallel worker (ranks 1..tp_size-1), started by parallel/launcher.py.

Reads {rank, config} as JSON on stdin, builds its shard with the same ModelRunner as rank 0, then
follows rank 0's broadcasts (steps, adapter operations, graph capture, graphed decode steps); no
scheduler, registry or HTTP. Exits 0 on `Stop` and 1 at once when rank 0 is gone or a collective
fails, so it never outlives the server.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import torch

from appliance.config.compose import config_from_dict
from appliance.config.schema import ApplianceConfig
from appliance.engine.model_runner import ModelRunner
from appliance.parallel.group import DecodeHeader, TPGroup, init_group, rank_device
from appliance.parallel.layout import TPLayout
from appliance.parallel.lora import WorkerAdapters
from appliance.parallel.messages import DropAdapter, FillSlot, ReadAdapter, RunStep, SetupDecode, Stop

log = logging.getLogger("appliance.parallel.worker")


def run_worker(cfg: ApplianceConfig, rank: int) -> None:
    device = rank_device(cfg.model.device, rank % cfg.parallel.ranks_per_node)
    if device.type == "cpu":
        # tp_size processes share the host's cores: without this each would start one thread per core.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.parallel.tp_size))
    group = init_group(cfg.parallel, rank, device)
    runner = ModelRunner(cfg, str(Path(cfg.model.path).expanduser()), tp=group)
    adapters: Optional[WorkerAdapters] = None
    if cfg.lora.enabled:
        adapters = WorkerAdapters(cfg.lora, runner.runtime.lora, runner.model, TPLayout(runner.args, rank, group.size),
                                  runner.dtype, runner.device)
    log.info("rank %d ready on %s", rank, device)
    follow(group, runner, adapters)
    if device.type == "cuda":
        # With NCCL the workers hung in teardown until the launcher's stop wait killed them. The process
        # ends anyway: leave at once and let the OS free its GPU memory and sockets.
        logging.shutdown()
        os._exit(0)
    group.quiesce()  # rank 0 and every worker tear down together (TPGroup.quiesce)
    group.destroy()


def follow(group: TPGroup, runner: ModelRunner, adapters: Optional[WorkerAdapters]) -> None:
    """Run what rank 0 broadcasts until `Stop`."""
    while True:
        msg = group.receive()
        if isinstance(msg, DecodeHeader):  # the common case: a decode step over the static buffers
            if runner.static_decode is None:
                raise RuntimeError("rank 0 sent a static decode step before SetupDecode")
            runner.static_decode.follow(msg)
        elif isinstance(msg, RunStep):
            if adapters is not None:
                adapters.begin_step(msg.batch.lora)
            runner.forward(msg.batch)
        elif isinstance(msg, SetupDecode):
            runner.start_static_decode(msg.sizes, msg.capture, adapters.ctx if adapters is not None else None)
        elif isinstance(msg, ReadAdapter):
            group.gather(adapters.read(msg) if adapters is not None else "lora.enabled is false on this rank")
        elif isinstance(msg, FillSlot):
            group.gather(adapters.fill(msg) if adapters is not None else "lora.enabled is false on this rank")
        elif isinstance(msg, DropAdapter):
            if adapters is not None:
                adapters.drop(msg)
        elif isinstance(msg, Stop):
            return
        else:
            raise TypeError(f"unknown message from rank 0: {type(msg).__name__}")


def _exit_with_parent(poll_s: float = 0.5) -> None:
    """Exit at once when the process that started us (rank 0) is gone: we are re-parented then."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                log.error("rank 0 (pid %d) is gone; exiting", parent)
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main() -> int:
    msg = json.load(sys.stdin.buffer)
    cfg, rank = config_from_dict(msg["config"]), int(msg["rank"])
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s tp-rank{rank} %(name)s: %(message)s")
    _exit_with_parent()
    try:
        run_worker(cfg, rank)
    except Exception:
        log.exception("tensor-parallel rank %d failed", rank)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
