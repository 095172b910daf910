"""Compile every Triton kernel the CPU kernel tests launch, for sm90, with the GPU host's triton, here.

The CPU suite runs the kernels in triton's interpreter, which takes code that the compiler refuses
(a jit helper's default string argument compiled under triton 3.9's interpreter and failed on the
H200's triton 3.6: "'str' object has no attribute 'type'"). This runs the kernel tests with the
interpreter off and triton's driver replaced by one that reports an sm90 CUDA target, each launch
turned into a compile only (JITFunction.run with warmup=True): every (kernel, specialization) the
tests reach is compiled to PTX and cubin with the installed ptxas. The launchers are told the
interpreter is on (so they take the tests' CPU tensors) but to keep bf16 tl.dot operands in bf16, as on
a GPU (every kernels module's dot_upcast answers False; else the bf16 cases would compile the
interpreter's fp32-upcast variants, e.g. tf32 wgmma in lora_gemm, where a GPU runs bf16 ones). The tests' own
assertions fail (nothing runs): their output is not shown; only compile errors count (and pytest
failing to run).

The tests' shapes are tiny, and on them lora_gemm takes its CPU tiles (mma.sync): the H200's own
configurations would never be compiled here. So the launchers are also called at Llama-3.1-8B shapes
with the tiles a GPU takes (PRODUCTION: lora_gemm's tiles in kernels/configs/NVIDIA_H200.json, fused shrink and h given, one tile a
program and the persistent grid; lora_shrink's 128-row prefill tiles; prefill attention's 128-row tiles). Every kernel whose PTX has wgmma
then goes through `ptxas -v` once more: ptxas info C7515 (it serialized the kernel's wgmmas because a
non-wgmma instruction defines accumulator registers while one is in flight: the right numbers at half
the speed) counts as an error; register spills are listed.

    make compile-check        # installs triton 3.6.0 (the GPU host's) beside the venv once, then runs this
    PYTHONPATH=DIR/with/triton-3.6 .venv/bin/python benchmarks/sm90_compile_check.py [pytest args, default tests/kernels]

Prints the kernels compiled and each compile error (kernel, exception); exit 1 on any error.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import pkgutil
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # before triton is imported: compile, do not interpret
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

COMPILED: dict[str, int] = {}
ERRORS: dict[tuple[str, str], str] = {}
SPILLS: dict[str, set[str]] = {}  # kernel -> ptxas's spill lines of its wgmma variants
PTXAS_CHECKED = [0]


class _Sm90Driver:
    """What JITFunction.run asks of the active driver when it only compiles."""

    def __init__(self, real) -> None:
        self._real = real

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def __getattr__(self, name):
        return getattr(self._real, name)


def _compile_only(self, *args, grid, warmup, **kwargs):
    name = self.fn.__qualname__
    try:
        kernel = _run(self, *args, grid=grid, warmup=True, **kwargs)
        COMPILED[name] = COMPILED.get(name, 0) + 1
        _ptxas_report(name, kernel)
        return kernel
    except Exception as e:  # noqa: BLE001 - every compile error is the report
        # triton's CompilationError names the call site; its cause (chained) says what failed
        chain, err = [], e
        while err is not None and len(chain) < 4:
            chain.append("".join(traceback.format_exception_only(type(err), err)).strip().splitlines())
            err = err.__cause__ or err.__context__
        ERRORS.setdefault((name, chain[-1][-1][:300]), "\n--- caused by ---\n".join("\n".join(m[-12:]) for m in chain))
        raise


_run = JITFunction.run


def ptxas_info(ptx: str) -> str | None:
    """What `ptxas -v` (triton's own) says of a kernel's PTX: registers, spills, and info such as C7515
    (triton keeps ptxas's messages to itself). None when triton ships no ptxas."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        arch = "sm_90a" if "sm_90a" in ptx else "sm_90"
        return subprocess.run([str(ptxas), f"-arch={arch}", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")],
                              capture_output=True, text=True).stderr


def _ptxas_report(name: str, kernel) -> None:
    """ptxas -v on a wgmma kernel's PTX: C7515 is an error, spills are listed."""
    ptx = kernel.asm.get("ptx", "")
    info = ptxas_info(ptx) if "wgmma.mma_async" in ptx else None
    if info is None:
        return
    PTXAS_CHECKED[0] += 1
    for line in info.splitlines():
        if "C7515" in line:
            ERRORS.setdefault((name, "ptxas serialized its wgmmas (C7515)"), line.strip())
        elif "spill" in line and "0 bytes spill stores, 0 bytes spill loads" not in line:
            SPILLS.setdefault(name, set()).add(line.strip())


def _production_launches() -> None:
    """The launches a GPU makes at Llama-3.1-8B shapes (bf16; fp16 for qkv_proj), CPU tensors: each
    is a compile only. lora_gemm with its H200 tiles, the fused shrink and h given (gate_up_proj's 28672
    columns take the persistent grid), and lora_shrink on a 4096-token prefill segment."""
    import torch

    import kernels.platform as platform
    from bench_kernels_gpu import LLAMA_8B, offsets
    from kernels.lora_gemm import lora_gemm
    from kernels.tile_config import for_device
    from kernels.lora_shrink import lora_shrink
    from kernels.segments import sgmv_segments

    cpu, T, R, S = torch.device("cpu"), 4096, 16, 4
    segs = sgmv_segments([T], [0], cpu)
    ranks = torch.full((S,), R, dtype=torch.int32)
    runs = [(p, torch.bfloat16) for p in LLAMA_8B] + [("qkv", torch.float16)]
    for proj, dtype in runs:
        K, slices = LLAMA_8B[proj]
        N, n = sum(slices), len(slices)
        offs = offsets(slices)
        x, w = torch.empty(T, K, dtype=dtype), torch.empty(N, K, dtype=dtype)
        A, B = torch.empty(S, n, R, K, dtype=dtype), torch.empty(S, N, R, dtype=dtype)
        h = torch.empty(T, n, R, dtype=torch.float32)
        for fused in (True, False):
            # the launcher runs the persistent grid's fused form only off the interpreter (a spin-wait
            # there would never end): answer as a GPU would for these calls
            interp = platform.interpreter_active
            platform.interpreter_active = lambda: False
            try:
                lora_gemm(x, w, None if fused else h, B, segs.row_slots, ranks, offs, A=A if fused else None,
                          tiles=for_device("NVIDIA H200").gemm(N, K))
            except Exception:  # noqa: BLE001 - recorded in ERRORS by _compile_only
                pass
            finally:
                platform.interpreter_active = interp
        if dtype == torch.bfloat16:
            try:
                lora_shrink(x, A, segs, ranks)
            except Exception:  # noqa: BLE001 - recorded in ERRORS by _compile_only
                pass
    _prefill_attention_launches()


def _prefill_attention_launches() -> None:
    """The prefill attention kernel with the tiles a GPU takes (128 rows) at Llama-3.1-8B's heads (32 / 8,
    head_dim 128) and SmolLM2's (9 / 3, head_dim 64), bf16 and fp16: compiles only."""
    import torch

    from kernels.prefill_attention import prefill_attention
    from kernels.prefill_tiles import prefill_tiles

    cpu = torch.device("cpu")
    for heads, kv_heads, d in ((32, 8, 128), (9, 3, 64)):
        tiles = prefill_tiles([(0, 64, 1024, list(range(68)))], 16, heads // kv_heads, cpu)
        for dtype in (torch.bfloat16, torch.float16):
            q = torch.empty(64, heads, d, dtype=dtype)
            cache = torch.empty(68, 16, kv_heads, d, dtype=dtype)
            try:
                prefill_attention(q, cache, cache, tiles, d ** -0.5)
            except Exception:  # noqa: BLE001 - recorded in ERRORS by _compile_only
                pass


def _gpu_dot_upcast(dtype) -> bool:
    """kernels.platform.dot_upcast's answer on a GPU: operands go to tl.dot in their own dtype."""
    return False


def main() -> int:
    if not triton.__version__.startswith("3.6"):
        print(f"note: triton {triton.__version__} (the H200 host has 3.6: PYTHONPATH=/tmp/t36)", flush=True)
    driver.set_active(_Sm90Driver(driver.active if _has_driver() else None))
    JITFunction.run = _compile_only
    import kernels.platform as platform
    # the launchers accept CPU tensors where the interpreter is on; every kernels module asks through
    # kernels.platform, so this one patch reaches them all
    platform.interpreter_active = lambda: True
    # ... but bf16 tl.dot operands as a GPU takes them (the interpreter's fp32 upcast is not what runs):
    # the launchers import dot_upcast by name, so each module's binding is replaced
    import kernels

    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"kernels.{info.name}")
        if hasattr(module, "dot_upcast"):
            module.dot_upcast = _gpu_dot_upcast
    args = sys.argv[1:] or [str(ROOT / "tests" / "kernels")]
    print(f"sm90 compile check: compiling the kernels that {' '.join(args)} launch ...", flush=True)
    # The tests' own outcomes are noise here (nothing runs): their output is kept back unless pytest
    # itself failed (exit codes other than 0 / 1: collection or usage errors, no tests).
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = pytest.main(["-q", "-p", "no:cacheprovider", "--no-header", "--tb=no", "-rN", "-o", "addopts=",
                            "--timeout=0", *args])
    if code not in (0, 1):
        print(out.getvalue())
        print(f"pytest could not run the tests (exit code {int(code)})")
        return 1
    print("... and the launches a GPU makes at Llama-3.1-8B shapes (lora_gemm's H200 tiles, lora_shrink's "
          "and prefill attention's prefill tiles)", flush=True)
    _production_launches()
    print(f"\ntriton {triton.__version__}, sm90: compiled {sum(COMPILED.values())} specializations of "
          f"{len(COMPILED)} kernels:", flush=True)
    for name, n in sorted(COMPILED.items()):
        print(f"  {name}: {n}")
    print(f"ptxas -v on the {PTXAS_CHECKED[0]} wgmma variants: C7515 (serialized wgmmas) is an error below; spills:")
    for name, lines in sorted(SPILLS.items()):
        for line in sorted(lines):
            print(f"  {name}: {line}")
    for (name, first), text in ERRORS.items():
        print(f"\nCOMPILE ERROR in {name}: {first}\n{text}")
    print(f"\n{len(ERRORS)} compile errors")
    if not COMPILED:
        print("nothing was compiled: the tests launched no kernel")
        return 1
    return 1 if ERRORS else 0


def _has_driver() -> bool:
    try:
        driver.active  # noqa: B018 - raises without a GPU
        return True
    except Exception:  # noqa: BLE001
        return False


if __name__ == "__main__":
    sys.exit(main())
