"""The tensor-parallel process group of one rank: set up from `parallel.*`, and its collectives.

Two groups over the same ranks: `device` for the model's collectives (nccl on cuda, gloo on cpu) and
`control`, gloo on the host, for what rank 0 broadcasts and gathers back, so a step's inputs never
make a GPU round trip. A control message is one broadcast of a fixed `inline_ints` int64 buffer
[kind, n fields, fields..., payload]; DECODE carries the staged decode rows inline (a gloo broadcast
costs about the same whatever its size), OBJECT is followed by a pickled object.
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
from appliance.engine.runtime import parallel_backend

log = logging.getLogger(__name__)

_IDLE_TIMEOUT = datetime.timedelta(days=3650)

# Control message: [kind, n, fields (n <= _HEADER - 2)..., payload...]
_HEADER = 8
OBJECT, DECODE = 0, 1


@dataclass(frozen=True)
class DecodeHeader:
    """What `receive` returns for a DECODE message: the step's ints; `receive_into` takes its tensors."""

    fields: tuple[int, ...]
    inline: bool  # the tensors came in the message buffer (else they follow as broadcasts of their own)


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
    # int64s per control message, the same on every rank: 64 KiB, a decode step of 64 sequences with
    # block tables up to ~120 blocks each.
    inline_ints: int = 8192

    def __post_init__(self) -> None:
        self._msg = torch.zeros(self.inline_ints, dtype=torch.long)  # reused: one message at a time

    # Under TP the process group's watchdog thread polls its own events during a CUDA-graph capture:
    # only the capturing thread's calls must be refused.
    capture_error_mode = "thread_local"

    def fail(self, reason: str) -> NoReturn:
        self.on_failure(reason)
        raise AssertionError("unreachable")  # on_failure never returns

    def in_step(self, step: Callable[[], Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
        """Run a step; a failure on rank 0 ends every rank (the ranks' collectives are out of step)."""
        try:
            return step()
        except Exception as e:  # noqa: BLE001 - cannot resynchronise
            self.fail(f"the step on rank 0 failed ({type(e).__name__}: {e}); tensor-parallel ranks "
                      "cannot resynchronise")

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
        dist.broadcast(self._head(OBJECT, []), src=0, group=self.control_group)
        dist.broadcast_object_list([obj], src=0, group=self.control_group)

    def broadcast_decode(self, fields: Sequence[int], tensors: Sequence[torch.Tensor]) -> None:
        """Rank 0: send a decode step's ints and its (cpu, integer) tensors, which the others take with
        `receive_into` into tensors of the same sizes."""
        n = sum(t.numel() for t in tensors)
        inline = _HEADER + n <= self.inline_ints
        msg = self._head(DECODE, [int(inline), *fields])
        if inline:
            off = _HEADER
            for t in tensors:
                msg[off:off + t.numel()].copy_(t)
                off += t.numel()
        dist.broadcast(msg, src=0, group=self.control_group)
        if not inline:
            for t in tensors:
                dist.broadcast(t, src=0, group=self.control_group)

    def receive(self) -> Any:
        """Ranks other than 0: the next message; a DecodeHeader for a decode step."""
        msg = self._msg
        dist.broadcast(msg, src=0, group=self.control_group)
        kind, n, *fields = msg[:_HEADER].tolist()
        if kind == DECODE:
            return DecodeHeader(tuple(fields[1:n]), inline=bool(fields[0]))
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.control_group)
        return box[0]

    def receive_into(self, head: DecodeHeader, tensors: Sequence[torch.Tensor]) -> None:
        """Ranks other than 0: the tensors of the decode step `receive` returned `head` for, in place."""
        off = _HEADER
        for t in tensors:
            if head.inline:
                t.copy_(self._msg[off:off + t.numel()].view(t.shape))
                off += t.numel()
            else:
                dist.broadcast(t, src=0, group=self.control_group)

    def _head(self, kind: int, fields: Sequence[int]) -> torch.Tensor:
        if len(fields) > _HEADER - 2:
            raise ValueError(f"a control message holds at most {_HEADER - 2} ints of header, got {len(fields)}")
        msg = self._msg
        msg[:2 + len(fields)] = torch.tensor([kind, len(fields), *fields], dtype=torch.long)
        return msg

    def gather(self, obj: Any) -> Optional[list[Any]]:
        """Every rank's `obj`, in rank order, on rank 0; None elsewhere."""
        out: Optional[list[Any]] = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.control_group)
        return out

    def quiesce(self, timeout_s: float = 10.0) -> None:
        """Before destroy, on CPU ranks: a barrier so no rank tears its gloo groups down while a peer
        still uses them (gloo then aborts the process). CUDA workers os._exit after Stop instead.
        A dead peer costs timeout_s and a warning, then teardown goes on."""
        if self.device.type == "cuda" or not dist.is_initialized():
            return
        try:
            dist.monitored_barrier(group=self.control_group, timeout=datetime.timedelta(seconds=timeout_s),
                                   wait_all_ranks=True)
        except RuntimeError as e:
            log.warning("tensor-parallel rank %d: not every rank reached teardown: %s", self.rank, e)

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass
class SingleRank:
    """The rank-1 group of tp_size 1: no process group, every collective the identity, a failing step's
    exception raised as it is (the engine reruns the step request by request)."""

    device: torch.device
    rank: int = 0
    size: int = 1
    capture_error_mode = "global"

    def in_step(self, step: Callable[[], Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
        return step()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather_last_dim(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        return x

    def min_int(self, n: int) -> int:
        return n

    def broadcast_decode(self, fields: Sequence[int], tensors: Sequence[torch.Tensor]) -> None:
        pass


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
    backend = parallel_backend(cfg, device)
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
