"""Probe: does triton 3.6's automatic warp specialization on Hopper give a base GEMM at cuBLAS's speed?

Round 12 (docs/benchmarks.md) found half of lora_gemm's prefill LoRA share is its Triton GEMM losing
~2.5 us a tile to cuBLAS, which overlaps a tile's epilogue with the next tile's main loop through warp
specialization. Round 9 checked `tl.range(..., warp_specialize=True)` on lora_gemm's tiles and saw
the same PTX: triton's Hopper pass (Meta's autoWS, third_party/nvidia/hopper) only runs for kernels
of num_warps=4 with no if/else in the function; lora_gemm has 8 warps. Here a plain bf16 TMA GEMM
(y = x @ W^T, device-side descriptors) in those terms: 4 warps per group (a producer group and two
consumer groups, each half of the row tile), a persistent grid or one tile a program, against
cuBLAS and lora_gemm with no adapter row (its GEMM alone), Llama-3.1-8B projections.

Round 13 (docs/benchmarks.md, docs/bench/h200-round13-ws-gemm.txt): the pass takes these kernels (12
warps, setmaxnreg) and the best, persistent 128 x 256 in 3 stages, runs 3.5-4.5 % behind cuBLAS, the
same as the persistent kernel without it (8 warps); 128 x 128 in 5 stages returns NaN (a miscompile).

    python3 benchmarks/probe_ws_gemm_gpu.py [--t 4096,8192] [--proj qkv,o,down]
    PYTHONPATH=.venv/gpu-triton python3 benchmarks/probe_ws_gemm_gpu.py --compile-only
        (no GPU: compile every variant for sm90 and report whether it was warp-specialized)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if "--compile-only" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

PROJ = {"qkv": (4096, 6144), "o": (4096, 4096), "down": (14336, 4096), "gate_up": (4096, 28672)}
# (name, BM, BN, BK, stages, warps, persistent, ws, epilogue subtiles)
VARIANTS = [
    ("ws pers 128x256 s3", 128, 256, 64, 3, 4, True, True, 1),
    ("ws pers 128x256 s2", 128, 256, 64, 2, 4, True, True, 1),
    ("ws pers 256x128 s3", 256, 128, 64, 3, 4, True, True, 1),
    ("ws tile 128x256 s3", 128, 256, 64, 3, 4, False, True, 1),
    ("ws pers 128x128 s4", 128, 128, 64, 4, 4, True, True, 1),
    ("ws pers 128x128 s5", 128, 128, 64, 5, 4, True, True, 1),
    ("no-ws pers 128x256 s3 w8", 128, 256, 64, 3, 8, True, False, 1),
    ("no-ws tile 128x256 s3 w8", 128, 256, 64, 3, 8, False, False, 1),
]


@triton.jit
def _tile_mn(tile, num_m, num_n, GROUP_M: tl.constexpr):
    group = GROUP_M * num_n
    first_m = (tile // group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (tile % group) % size_m, (tile % group) // size_m


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 GROUP_M: tl.constexpr, NUM_PROGS: tl.constexpr, PERSISTENT: tl.constexpr,
                 WS: tl.constexpr, SUB: tl.constexpr, STAGES: tl.constexpr):
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    y_desc = tl.make_tensor_descriptor(y_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN // SUB])
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    k_steps = tl.cdiv(K, BK)
    if PERSISTENT:
        last = num_m * num_n
        step = NUM_PROGS
    else:
        last = tl.program_id(0) + 1
        step = 1
    for tile in tl.range(tl.program_id(0), last, step, flatten=False, warp_specialize=WS):
        pid_m, pid_n = _tile_mn(tile, num_m, num_n, GROUP_M)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in tl.range(k_steps, num_stages=STAGES):
            a = x_desc.load([pid_m * BM, ki * BK])
            b = w_desc.load([pid_n * BN, ki * BK])
            acc = tl.dot(a, b.T, acc)
        if SUB == 1:
            y_desc.store([pid_m * BM, pid_n * BN], acc.to(tl.bfloat16))
        else:
            acc0, acc1 = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
            y_desc.store([pid_m * BM, pid_n * BN], acc0.to(tl.bfloat16))
            y_desc.store([pid_m * BM, pid_n * BN + BN // 2], acc1.to(tl.bfloat16))


def num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132


def launch(x, w, y, v):
    _, BM, BN, BK, stages, warps, pers, ws, sub = v
    M, K = x.shape
    N = w.shape[0]
    tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    progs = min(num_sms(), tiles) if pers else tiles
    return _gemm_kernel[(progs,)](x, w, y, M, N, K, BM=BM, BN=BN, BK=BK, GROUP_M=8, NUM_PROGS=progs,
                                  PERSISTENT=pers, WS=ws, SUB=sub, STAGES=stages, num_warps=warps,
                                  num_stages=stages)


def compile_only() -> None:
    """Compile each variant for sm90 (no GPU) and say whether the warp-specialize pass took it."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for v in VARIANTS:
        name, BM, BN, BK, stages, warps, pers, ws, sub = v
        sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32"}
        consts = dict(BM=BM, BN=BN, BK=BK, GROUP_M=8, NUM_PROGS=132, PERSISTENT=pers, WS=ws, SUB=sub, STAGES=stages)
        for k, val in consts.items():
            sig[k] = "constexpr"
        src = ASTSource(_gemm_kernel, sig, constexprs={(list(sig).index(k),): val for k, val in consts.items()},
                        attrs={(i,): [["tt.divisibility", 16]] for i in range(6)})
        try:
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": warps, "num_stages": stages})
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"{name:28s} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        ptx = k.asm["ptx"]
        ttgir = k.asm["ttgir"]
        print(f"{name:28s} warps {k.metadata.num_warps:2d} smem {k.metadata.shared:6d} "
              f"setmaxnreg {ptx.count('setmaxnreg'):2d} warp_specialize op {'ttg.warp_specialize' in ttgir} "
              f"wgmma {ptx.count('wgmma.mma_async'):3d}")


def bench(args) -> None:
    from bench_kernels_gpu import DEV, interleaved_times
    from kernels.lora_gemm import lora_gemm

    triton.set_allocator(lambda size, align, stream: torch.empty(size, device=DEV, dtype=torch.int8))
    print(f"{torch.cuda.get_device_name(DEV)}, torch {torch.__version__}, triton {triton.__version__}")
    rows = []
    for proj in args.proj.split(","):
        K, N = PROJ[proj]
        for T in [int(t) for t in args.t.split(",")]:
            x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16) * 0.1
            w = torch.randn(N, K, device=DEV, dtype=torch.bfloat16) * 0.02
            want = x @ w.t()
            fns, names = [lambda: torch.mm(x, w.t())], ["cuBLAS"]
            ys = []
            for v in VARIANTS:
                y = torch.empty(T, N, device=DEV, dtype=torch.bfloat16)
                try:
                    launch(x, w, y, v)
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001
                    print(f"{proj} {T} {v[0]}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                    continue
                err = (y.float() - want.float()).abs().max().item()
                ok = err < 0.05 * want.float().abs().max().item()
                names.append(v[0] + ("" if ok else f" WRONG {err:.3g}"))
                fns.append(lambda v=v, y=y: launch(x, w, y, v))
                ys.append(y)
            # lora_gemm with every row a base token: the shipped Triton GEMM alone (round 12's figure)
            base_rows = torch.full((T,), -1, dtype=torch.int32, device=DEV)
            A = torch.zeros(4, 1, 16, K, device=DEV, dtype=torch.bfloat16)
            B = torch.zeros(4, N, 16, device=DEV, dtype=torch.bfloat16)
            ranks = torch.full((4,), 16, dtype=torch.int32, device=DEV)
            offs = [0, N]
            fns.append(lambda: lora_gemm(x, w, None, B, base_rows, ranks, offs, A=A))
            names.append("lora_gemm, no adapter row")
            times = interleaved_times(fns, reps=args.reps)
            base = times[0]
            for name, t in zip(names, times):
                rows.append((proj, T, name, t * 1e6, 100 * (t - base) / base))
    print()
    print("| proj | T | kernel | us | vs cuBLAS |")
    print("|---|---|---|---|---|")
    for proj, T, name, us, pct in rows:
        print(f"| {proj} | {T} | {name} | {us:.1f} | {pct:+.1f} % |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--t", default="4096,8192")
    ap.add_argument("--proj", default="qkv,o,down")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    if args.compile_only:
        compile_only()
    else:
        bench(args)


if __name__ == "__main__":
    main()
