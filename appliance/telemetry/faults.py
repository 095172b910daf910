"""Debug fault injection: make a real forward step fail, or a cold adapter read slow, to exercise the
engine's failure and overlap-loading paths.

Off unless `debug.fault_injection_token_id` is set. Then a forward pre-hook on the model raises
`InjectedFault` inside the real forward call of any step whose input tokens hold that id: a prompt
containing it fails at its prefill (together with every request in the same step, as any forward
failure does), and the engine goes on serving. Nothing is mocked: the engine, the scheduler and the
HTTP layer see the exception exactly as they would see a kernel or device error.

`debug.fault_injection_read_delay_s` makes every cold adapter read (disk -> CPU tier) sleep first, as a
slow disk would: the real read follows, so its result is exactly the undelayed one.
"""

from __future__ import annotations

import time

import torch
from torch import nn


class InjectedFault(RuntimeError):
    """Raised by the forward hook that debug.fault_injection_token_id installs."""


def install_token_fault(model: nn.Module, token_id: int) -> None:
    """Make `model`'s forward raise when its first argument (input ids [T]) holds `token_id`."""

    def check(module: nn.Module, args: tuple) -> None:
        input_ids: torch.Tensor = args[0]  # [T]
        if bool((input_ids == token_id).any()):
            raise InjectedFault(f"injected fault: token id {token_id} in this step's input "
                                "(debug.fault_injection_token_id is set)")

    model.register_forward_pre_hook(check)


def slow_read(seconds: float) -> None:
    """debug.fault_injection_read_delay_s: a cold adapter read waits this long first, as on a slow disk.

    Runs where the read runs (the engine thread, or a reader thread with lora.overlap_loading), so it
    shows exactly what a slow disk does to the running batch in either mode.
    """
    time.sleep(seconds)
