"""Start-up warm-up: run once every Triton kernel variant a step can hit, so no request pays a compile.

Triton compiles a kernel on each new combination of compile-time constants, which on a GPU costs a
request seconds of TTFT. The decode graphs compile their sizes at capture; this module plans a bounded
set of eager steps (prefill lengths around each tile bucket, mixed prefill + decode with split and
unsplit attention, eager decode sizes; pure Python) and runs each once on synthetic inputs. Nothing
is visible afterwards: K/V go to the padding block, LoRA slots are only read, logits are dropped.
Layouts outside the plan still compile on first use; the bench counts those (engine/kernel_variants.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from appliance.engine.model_runner import ModelRunner

log = logging.getLogger(__name__)

# Segment lengths either side of the launchers' tile buckets: shrink 16 / 256 / 512 rows, expand 16 / 32,
# lora_linear from 64 tokens (CUDA, lora/backend/policy.MIN_TOKENS_CUDA). Longer ones are clipped to the
# step's token budget.
PREFILL_LENGTHS = (2, 16, 17, 32, 33, 63, 64, 255, 256, 257, 512, 513)
LONG_CONTEXT = 1024  # decode rows' context for the split attention kernel (>= 2 parts of 512)
SHORT_CONTEXT = 16  # decode rows' context for the unsplit one


@dataclass(frozen=True)
class WarmupStep:
    """One synthetic step: prefill sequences (no cached context) first, then decode rows."""

    prefill_lens: tuple[int, ...]  # tokens of each prefill sequence
    prefill_slots: tuple[int, ...]  # LoRA slot of each, -1 = base
    decode_slots: tuple[int, ...] = ()  # one decode row each: its slot, -1 = base
    decode_context: int = 0  # context length of every decode row (this step's token included)
    label: str = ""

    @property
    def num_tokens(self) -> int:
        return sum(self.prefill_lens) + len(self.decode_slots)


@dataclass(frozen=True)
class WarmupReport:
    steps: int
    seconds: float
    compiled: Optional[int]  # Triton kernel variants compiled by the warm-up (None: not countable here)


def plan_warmup(max_tokens: int, max_model_len: int, max_seqs: int, num_slots: int,
                decode_sizes: list[int], eager_decode: bool) -> list[WarmupStep]:
    """The steps to run (bounded: ~3 per prefill length + 2 mixed + 2 per decode size). num_slots 0 =
    LoRA off; eager_decode: no graphs, so decode-only steps are warmed here instead of by the capture."""
    steps: list[WarmupStep] = []
    cap = min(max_tokens, max_model_len - 1)
    slot = (lambda i: i % num_slots) if num_slots else (lambda i: -1)
    if num_slots:
        for n in sorted({min(n, cap) for n in PREFILL_LENGTHS + (cap,) if n >= 1}):
            steps.append(WarmupStep((n,), (0,), label=f"prefill {n}, 1 adapter"))
            if max_seqs >= 2 and 2 * n <= max_tokens:
                steps.append(WarmupStep((n, n), (0, -1), label=f"prefill {n}, 1 adapter + base"))
            g = min(num_slots, max_tokens // n, max_seqs)
            if g > 2:
                steps.append(WarmupStep((n,) * g, tuple(range(g)), label=f"prefill {n}, {g} adapters"))
    else:
        steps.append(WarmupStep((cap,), (-1,), label=f"prefill {cap}, base"))
    # Mixed steps: a short prefill beside decode rows; attention split (few rows, long context) and not.
    long_ctx = min(LONG_CONTEXT, max_model_len)
    short_ctx = min(SHORT_CONTEXT, max_model_len)
    p = min(16, cap)
    if max_seqs >= 2 and p + 1 <= max_tokens:
        steps.append(WarmupStep((p,), (slot(0),), (slot(1),), long_ctx, label="mixed, 1 decode, long context"))
        d = min(max_seqs - 1, max_tokens - p, 64)
        steps.append(WarmupStep((p,), (slot(0),), tuple(slot(i + 1) for i in range(d)), short_ctx,
                                label=f"mixed, {d} decodes"))
    # One-token segments only: decode-only steps without graphs, or a 1-token prefill chunk among decodes.
    if eager_decode or num_slots:
        for b in sorted({min(b, max_seqs, max_tokens) for b in decode_sizes}):
            rows = tuple(slot(i) for i in range(b))
            if eager_decode:
                steps.append(WarmupStep((), (), rows, short_ctx, label=f"decode {b}"))
                if long_ctx > short_ctx:
                    steps.append(WarmupStep((), (), rows, long_ctx, label=f"decode {b}, long context"))
            elif num_slots and b >= 2:
                steps.append(WarmupStep((1,), (slot(0),), rows[:b - 1], short_ctx, label=f"1-token prefill + {b - 1}"))
    return steps


def run_warmup(runner: "ModelRunner", steps: list[WarmupStep], token_id: int) -> WarmupReport:
    """Run each step once through the runner's forward (TP: broadcast to the other ranks as well)."""
    from appliance.engine.kernel_variants import compiled_variants
    from appliance.engine.step import StepBatch

    bs = runner.block_size
    pad_slot = runner.pad_block * bs
    before = compiled_variants()
    t0 = time.perf_counter()
    for st in steps:
        ids: list[int] = []
        prefills = []
        for n in st.prefill_lens:
            prefills.append((len(ids), n, 0, [runner.pad_block] * -(-n // bs)))
            ids.extend([token_id] * n)
        num_prefill = len(ids)
        pos = [p for n in st.prefill_lens for p in range(n)]
        logits = [q0 + n - 1 for q0, n, _, _ in prefills]
        d = len(st.decode_slots)
        ctx = st.decode_context
        ids += [token_id] * d
        pos += [ctx - 1] * d
        logits += list(range(num_prefill, num_prefill + d))
        batch = StepBatch(
            input_ids=ids, positions=pos, slot_mapping=[pad_slot] * len(ids), prefills=prefills,
            num_prefill_tokens=num_prefill, decode_tables=[[0] * -(-ctx // bs) for _ in range(d)],
            decode_context_lens=[ctx] * d, logits_indices=logits)
        runner.warm_step(batch, list(st.prefill_lens) + [1] * d, list(st.prefill_slots) + list(st.decode_slots))
    runner.synchronize()
    after = compiled_variants()
    report = WarmupReport(len(steps), time.perf_counter() - t0,
                          None if before is None or after is None else after - before)
    log.info("warm-up: %d steps in %.1f s (%s Triton kernel variants compiled)", report.steps, report.seconds,
             "?" if report.compiled is None else report.compiled)
    return report
