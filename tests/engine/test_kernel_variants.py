"""engine/kernel_variants.py: which variants of the layout-dependent kernels this process has compiled."""

from __future__ import annotations

import pytest

import appliance.engine.kernel_variants as variants


def test_compiled_keys_reads_every_layout_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each entry must be a Triton JIT function (a renamed kernel fails at import, not drop out of the count).
    for fn in variants.LAYOUT_KERNELS:
        assert hasattr(fn, "fn"), fn
    if variants.interpreter_active():
        assert variants.compiled_keys() is None  # the interpreter compiles nothing
    monkeypatch.setattr(variants, "interpreter_active", lambda: False)
    keys = variants.compiled_keys()
    assert keys is None or isinstance(keys, set)  # None: this triton's JIT keeps no device_caches
