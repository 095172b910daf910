"""The tensor-parallel process group of one rank: set up from `parallel.*`, and its collectives.

Two groups over the same ranks: `device` for the model's collectives (nccl on cuda, gloo on cpu) and
`control`, always gloo on the host, for what rank 0 broadcasts (each step's batch, adapter operations)
and what it gathers back (their results). Keeping control messages on the host means a step's inputs
never make a GPU round trip before the forward, as vLLM's cpu_group does.

Every control message starts with a fixed header of ints, [kind, *fields]: kind OBJECT is followed
by one object (torch's broadcast_object_list: pickled, two broadcasts), kind DECODE by a static decode
step's staged int tensors, whose sizes the fields give. The decode step is the message of every
token, and as plain tensors it costs no pickling and no size round (engine/cuda_graph.py).
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, NoReturn, Optional, Sequence

import torch
import torch.distributed as dist

from appliance.config.schema import ConfigError, ParallelConfig

log = logging.getLogger(__name__)

_IDLE_TIMEOUT = datetime.timedelta(days=3650)

# Control header: [kind, field...]; DECODE carries engine.cuda_graph.DecodeStep's ints.
_HEADER_LEN = 8
OBJECT, DECODE = 0, 1


@dataclass(frozen=True)
class DecodeHeader:
    """What `receive` returns for a DECODE message: the step's ints; its tensors follow (receive_into)."""

    fields: tuple[int, ...]


def _exit_now(reason: str) -> NoReturn:
    log.critical("tensor parallelism failed: %s; exiting", reason)
    os._exit(1)


@dataclass
class TPGroup:
    rank: int
    size: int
    device: torch.device
    device_group: Any  # dist.ProcessGroup for the model's all-reduce / gather
    control_group: Any  # gloo dist.ProcessGroup for broadcast objects
    # Called when this rank cannot go on (a collective out of step); never returns. Rank 0's launcher
    # replaces it with one that also stops the workers.
    on_failure: Callable[[str], NoReturn] = field(default=_exit_now)

    def fail(self, reason: str) -> NoReturn:
        self.on_failure(reason)
        raise AssertionError("unreachable")  # on_failure never returns

    # ------------------------------------------------------------------ model collectives
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (row-parallel outputs, the vocab-parallel embedding)."""
        dist.all_reduce(x, group=self.device_group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """x [N, V/size] on every rank -> [N, V] on rank 0 (ranks in order), None elsewhere.
        all_gather rather than gather: every backend has it (older NCCL builds lack gather), and the
        extra copies are logits-sized, small next to a step."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.device_group)
        return torch.cat(parts, dim=-1) if self.rank == 0 else None

    def min_int(self, n: int) -> int:
        """The smallest of every rank's `n` (KV block count: each rank may have different free memory)."""
        t = torch.tensor([n], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control_group)
        return int(t.item())

    # ------------------------------------------------------------------ control messages
    def broadcast(self, obj: Any) -> None:
        """Rank 0: send `obj` to every other rank (their `receive` returns it)."""
        self._header(OBJECT, [])
        dist.broadcast_object_list([obj], src=0, group=self.control_group)

    def broadcast_decode(self, fields: Sequence[int], tensors: Sequence[torch.Tensor]) -> None:
        """Rank 0: send a decode step's ints, then its (cpu) tensors, which the others `receive_into`
        tensors of the same sizes."""
        self._header(DECODE, fields)
        for t in tensors:
            dist.broadcast(t, src=0, group=self.control_group)

    def receive(self) -> Any:
        """Ranks other than 0: the next message; a DecodeHeader for a decode step."""
        head = torch.zeros(_HEADER_LEN, dtype=torch.long)
        dist.broadcast(head, src=0, group=self.control_group)
        kind, n, *rest = head.tolist()
        if kind == DECODE:
            return DecodeHeader(tuple(rest[:n]))
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.control_group)
        return box[0]

    def receive_into(self, tensors: Sequence[torch.Tensor]) -> None:
        """Ranks other than 0: the tensors of the decode step `receive` announced, in place."""
        for t in tensors:
            dist.broadcast(t, src=0, group=self.control_group)

    def _header(self, kind: int, fields: Sequence[int]) -> None:
        if len(fields) > _HEADER_LEN - 2:
            raise ValueError(f"a control header holds at most {_HEADER_LEN - 2} ints, got {len(fields)}")
        head = torch.zeros(_HEADER_LEN, dtype=torch.long)
        head[:2 + len(fields)] = torch.tensor([kind, len(fields), *fields], dtype=torch.long)
        dist.broadcast(head, src=0, group=self.control_group)

    def gather(self, obj: Any) -> Optional[list[Any]]:
        """Every rank's `obj`, in rank order, on rank 0; None elsewhere."""
        out: Optional[list[Any]] = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.control_group)
        return out

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def rank_device(model_device: str, rank: int) -> torch.device:
    """The device of `rank` (its index among the ranks of its host): cuda:rank on CUDA (model.device
    auto or cuda), cpu otherwise."""
    if model_device == "cpu" or (model_device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if model_device.startswith("cuda:"):
        raise ConfigError(f"model.device: {model_device!r} names one GPU, but parallel.tp_size > 1 puts rank r "
                          "on cuda:r; set model.device to cuda or auto")
    if not torch.cuda.is_available():
        raise ConfigError(f"model.device: {model_device!r} asked for, but torch sees no CUDA device")
    if rank >= torch.cuda.device_count():
        raise ConfigError(f"parallel.tp_size: local rank {rank} needs cuda:{rank} but torch sees "
                          f"{torch.cuda.device_count()} GPU(s) on this host")
    return torch.device("cuda", rank)


def init_group(cfg: ParallelConfig, rank: int, device: torch.device, timeout_s: float = 600.0) -> TPGroup:
    """Join the group of cfg.tp_size ranks at tcp://master_addr:master_port (rank 0 hosts the store)."""
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError("parallel.backend: nccl needs CUDA devices; use gloo (or auto) on cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=f"tcp://{cfg.master_addr}:{cfg.master_port}",
                            rank=rank, world_size=cfg.tp_size, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)
    # Workers wait in the control group's broadcast while the server is idle, for as long as it is idle:
    # its timeout must not end them (the device group keeps the short one, for collectives in a step).
    control = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
    return TPGroup(rank, cfg.tp_size, device, dist.group.WORLD, control)
