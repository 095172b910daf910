"""Every `auto` and null setting resolved once at start, for this process's device, into one frozen
record: the runner, the LoRA manager and the engine read it, and /v1/status shows it (`runtime`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch

from appliance.config.schema import ApplianceConfig, ConfigError, EngineConfig, LoRAConfig, ParallelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LoRARuntime:
    backend: str  # torch | triton | csgmv
    sorted_decode: bool  # the decode CUDA graphs may sort rows by slot (csgmv's chunks)
    decode_side_stream: bool
    prefill_gemm: Optional[str]  # cublas | triton; None = by each step's shape (lora/backend/policy.py)


@dataclass(frozen=True)
class Runtime:
    device: str
    dtype: str
    attention_backend: str  # triton | torch
    fused_kernels: str  # triton | torch
    decode_graphs: bool  # decode steps captured as CUDA graphs
    decode_graphs_off: Optional[str]  # why not, for the log
    warmup: bool
    async_scheduling: bool
    parallel_backend: Optional[str]  # nccl | gloo; None at tp_size 1
    lora: Optional[LoRARuntime]  # None: lora.enabled is false

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def view(self) -> dict[str, Any]:
        return asdict(self)


def resolve_runtime(cfg: ApplianceConfig, device: torch.device, tp_size: int = 1) -> Runtime:
    """`device`: model.device resolved (resolve_device), or this rank's device under tensor parallelism."""
    dtype = resolve_dtype(cfg.model.dtype, device)
    attention = resolve_triton_or_torch("engine.attention_backend", cfg.engine.attention_backend, device)
    fused = resolve_triton_or_torch("engine.fused_kernels", cfg.engine.fused_kernels, device)
    lora = resolve_lora(cfg.lora, device, dtype, tp_size) if cfg.lora.enabled else None
    off = graphs_off_reason(cfg, device, attention, None if lora is None else lora.backend)
    a = cfg.engine.async_scheduling
    return Runtime(device=str(device), dtype=str(dtype).removeprefix("torch."), attention_backend=attention,
                   fused_kernels=fused, decode_graphs=off is None, decode_graphs_off=off,
                   warmup=warmup_on(cfg.engine, device.type),
                   async_scheduling=(off is None and tp_size == 1) if a is None else a,
                   parallel_backend=parallel_backend(cfg.parallel, device) if tp_size > 1 else None, lora=lora)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"model.device: {name!r} asked for, but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def resolve_triton_or_torch(key: str, name: str, device: torch.device) -> str:
    """An `auto|triton|torch` setting (engine.attention_backend, engine.fused_kernels) -> "triton" |
    "torch": auto is triton on cuda where Triton runs; an explicit triton must be able to run here."""
    if name == "auto":
        return "triton" if device.type == "cuda" and _triton_reason(device) is None else "torch"
    if name == "triton":
        why = _triton_reason(device)
        if why is not None:
            raise ConfigError(f"{key}: 'triton' cannot run here: {why}")
    return name


def resolve_attention_backend(name: str, device: torch.device) -> str:
    return resolve_triton_or_torch("engine.attention_backend", name, device)


def resolve_fused_kernels(name: str, device: torch.device) -> str:
    return resolve_triton_or_torch("engine.fused_kernels", name, device)


def _triton_reason(device: torch.device) -> Optional[str]:
    from kernels.platform import triton_unavailable_reason

    return triton_unavailable_reason(device)


def parallel_backend(cfg: ParallelConfig, device: torch.device) -> str:
    """torch.distributed's backend: auto = nccl on cuda, gloo on cpu."""
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError("parallel.backend: nccl needs CUDA devices; use gloo (or auto) on cpu")
    return backend


def warmup_on(e: EngineConfig, device_type: str) -> bool:
    """Whether the start-up warm-up runs on a device of this type (`warmup` null = cuda only)."""
    return e.warmup if e.warmup is not None else device_type == "cuda"


def graphs_off_reason(cfg: ApplianceConfig, device: torch.device, attention_backend: str,
                      lora_backend: Optional[str]) -> Optional[str]:
    """None when decode steps can be captured as CUDA graphs, else why not."""
    if cfg.engine.enforce_eager:
        return "engine.enforce_eager is true"
    if device.type != "cuda":
        return f"the model runs on {device}"
    if attention_backend != "triton":
        return "engine.attention_backend is torch (its gather is sized by a host int)"
    if lora_backend == "torch":
        return "lora.backend torch groups tokens on the host per step"
    if cfg.debug.fault_injection_token_id is not None:
        return "debug.fault_injection_token_id checks the inputs on the host"
    return None


def piecewise_off_reason(runtime: Runtime, tp_size: int, sizes: list[int]) -> Optional[str]:
    """None when steps with prefills can run as piecewise CUDA graphs (engine/piecewise.py), else why not."""
    if not sizes:
        return "engine.piecewise_graph_tokens is [] (on cpu: null)"
    if runtime.decode_graphs_off is not None:
        return runtime.decode_graphs_off
    if tp_size > 1:
        return "not available under tensor parallelism"
    return None


def lora_backend(cfg: LoRAConfig, device: torch.device) -> str:
    """auto = triton on CUDA (the kernels and the decode CUDA graphs), torch elsewhere; else as given."""
    if cfg.backend != "auto":
        return cfg.backend
    return "triton" if device.type == "cuda" else "torch"


def sorted_decode(cfg: LoRAConfig, device: torch.device) -> bool:
    """Whether the decode CUDA graphs may sort their rows by slot into csgmv's chunks (at sizes with enough
    rows per slot, engine/cuda_graph.py): backend csgmv, and auto on CUDA; triton as given keeps one-token
    segments."""
    return cfg.backend == "csgmv" or (cfg.backend == "auto" and device.type == "cuda")


def resolve_lora(cfg: LoRAConfig, device: torch.device, dtype: torch.dtype, tp_size: int = 1) -> LoRARuntime:
    backend = lora_backend(cfg, device)
    if backend != "torch":
        why = _triton_reason(device)
        if why is not None:
            raise ConfigError(f"lora.backend: {cfg.backend!r} cannot run here: {why}")
    if cfg.prefill_gemm == "triton" and backend != "torch":
        from kernels.lora_gemm import platform_reason

        why = platform_reason(device, dtype)
        if why is not None:
            raise ConfigError(f"lora.prefill_gemm: 'triton' cannot run here: {why}; use auto or cublas")
    aside = cfg.decode_side_stream
    if aside is None:  # where it was measured to pay: one CUDA device
        aside = device.type == "cuda" and tp_size == 1
    return LoRARuntime(backend=backend, sorted_decode=sorted_decode(cfg, device),
                       decode_side_stream=bool(aside) and backend != "torch",
                       prefill_gemm=None if cfg.prefill_gemm == "auto" else cfg.prefill_gemm)
