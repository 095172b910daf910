"""kernels/platform.py: which variants of the layout-dependent kernels this process has compiled."""

from __future__ import annotations

import importlib

import pytest

import kernels.platform as platform


def test_compiled_keys_looks_up_kernels_that_exist(monkeypatch: pytest.MonkeyPatch) -> None:
    # compiled_keys finds the kernels among the imported modules by name (importing them would be a
    # cycle): a renamed kernel must fail here, not drop out of the bench's count.
    for module_name, fn_name in platform._LAYOUT_KERNELS:
        assert hasattr(importlib.import_module(module_name), fn_name), (module_name, fn_name)
    if platform.interpreter_active():
        assert platform.compiled_keys() is None  # the interpreter compiles nothing
    monkeypatch.setattr(platform, "interpreter_active", lambda: False)
    keys = platform.compiled_keys()
    assert keys is None or isinstance(keys, set)  # None: this triton's JIT keeps no device_caches
