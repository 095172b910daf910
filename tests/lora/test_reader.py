"""BackgroundReader: reads run on other threads, one per key at a time, outcomes come back by poll."""

from __future__ import annotations

import threading

import pytest

from appliance.lora.reader import BackgroundReader


def test_read_runs_off_the_calling_thread_once_per_key_and_comes_back_by_poll() -> None:
    gate = threading.Event()
    ended = threading.Event()
    threads: list[str] = []

    def read() -> str:
        threads.append(threading.current_thread().name)
        gate.wait(30)
        return "weights"

    r: BackgroundReader[str] = BackgroundReader(2, on_done=ended.set)
    assert r.start("a@0", read) is True
    assert r.start("a@0", read) is False  # one read per key in flight
    assert r.busy("a@0") and r.in_flight == 1
    assert r.poll() == []  # still blocked in read()
    gate.set()
    assert ended.wait(30)
    assert r.busy("a@0")  # finished but not polled: still counted, so the engine takes it in first
    [o] = r.poll()
    assert (o.key, o.result, o.ok) == ("a@0", "weights", True) and o.duration_s >= 0
    assert not r.busy("a@0") and r.in_flight == 0
    assert threads[0].startswith("lora-read") and threads[0] != threading.current_thread().name
    r.shutdown()


def test_failed_read_is_an_outcome_not_an_exception() -> None:
    ended = threading.Event()

    def bad() -> str:
        raise ValueError("truncated file")

    r: BackgroundReader[str] = BackgroundReader(1, on_done=ended.set)
    r.start("b@1", bad)
    assert ended.wait(30)
    [o] = r.poll()
    assert not o.ok and isinstance(o.result, ValueError) and str(o.result) == "truncated file"
    assert r.start("b@1", lambda: "ok") is True  # a failed key can be read again
    r.shutdown()


def test_reader_needs_a_thread() -> None:
    with pytest.raises(ValueError, match="threads must be >= 1"):
        BackgroundReader(0)
