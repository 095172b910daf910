"""Compile every Triton kernel the CPU kernel tests launch, for sm90, with the GPU host's triton, here.

The CPU suite runs the kernels in triton's interpreter, which takes code that the compiler refuses
(a jit helper's default string argument compiled under triton 3.9's interpreter and failed on the
H200's triton 3.6: "'str' object has no attribute 'type'"). This runs the kernel tests with the
interpreter off and triton's driver replaced by one that reports an sm90 CUDA target, each launch
turned into a compile only (JITFunction.run with warmup=True): every (kernel, specialization) the
tests reach is compiled to PTX and cubin with the installed ptxas. The launchers are told the
interpreter is on (so they take the tests' CPU tensors) but to keep bf16 tl.dot operands in bf16, as on
a GPU (kernels.platform.UPCAST_BF16_DOTS; before round 10 the bf16 cases compiled the interpreter's
fp32-upcast variants, e.g. tf32 wgmma in lora_gemm, where the H200 runs bf16 ones). The tests' own
assertions fail (nothing runs): their output is not shown; only compile errors count (and pytest
failing to run).

    make compile-check        # installs triton 3.6.0 (the GPU host's) beside the venv once, then runs this
    PYTHONPATH=DIR/with/triton-3.6 .venv/bin/python benchmarks/sm90_compile_check.py [pytest args, default tests/kernels]

Prints the kernels compiled and each compile error (kernel, exception); exit 1 on any error.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
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


def main() -> int:
    if not triton.__version__.startswith("3.6"):
        print(f"note: triton {triton.__version__} (the H200 host has 3.6: PYTHONPATH=/tmp/t36)", flush=True)
    driver.set_active(_Sm90Driver(driver.active if _has_driver() else None))
    JITFunction.run = _compile_only
    import kernels.platform as platform
    # the launchers accept CPU tensors where the interpreter is on; every kernels module asks through
    # kernels.platform, so this one patch reaches them all
    platform.interpreter_active = lambda: True
    # ... but bf16 tl.dot operands as a GPU takes them (the interpreter's fp32 upcast is not what runs)
    platform.UPCAST_BF16_DOTS = False
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
    print(f"\ntriton {triton.__version__}, sm90: compiled {sum(COMPILED.values())} specializations of "
          f"{len(COMPILED)} kernels:", flush=True)
    for name, n in sorted(COMPILED.items()):
        print(f"  {name}: {n}")
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
