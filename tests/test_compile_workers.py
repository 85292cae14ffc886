"""How many worker processes a build compiles its graphs in (the builds themselves: test_build_run.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trtbuild.backends.torch import compile_workers
from trtbuild.errors import TrtbuildError


@pytest.mark.parametrize("value", ["-1", "two", "1.5"])
def test_a_bad_worker_count_is_an_error_naming_the_variable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(compile_workers.ENV, value)
    with pytest.raises(TrtbuildError, match=f"{compile_workers.ENV}.*{value}"):
        compile_workers.worker_count(3, 1, "cpu")


def test_a_set_count_is_a_cap_and_the_build_keeps_one_graph_for_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(compile_workers.ENV, "8")
    assert compile_workers.worker_count(3, 1, "cpu") == 2
    assert compile_workers.worker_count(1, 1, "cpu") == 0
    monkeypatch.setenv(compile_workers.ENV, "0")
    assert compile_workers.worker_count(3, 1, "cpu") == 0


def test_auto_needs_four_cores_and_memory_for_each_workers_copy_of_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(compile_workers.ENV, raising=False)
    monkeypatch.setattr(compile_workers.os, "cpu_count", lambda: 2)
    assert compile_workers.worker_count(3, 1, "cpu") == 0
    monkeypatch.setattr(compile_workers.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(compile_workers, "_free_device_bytes", lambda device: 100 << 30)
    assert compile_workers.worker_count(3, 1 << 30, "cpu") == 2
    assert compile_workers.worker_count(3, 60 << 30, "cpu") == 1  # 80 GiB usable holds one 60 GiB copy
    assert compile_workers.worker_count(3, 90 << 30, "cpu") == 0


def test_gpu_timings_hold_the_shared_lock_and_the_benchmarker_is_restored_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside `timing_alone`, Inductor's GPU timing runs only while this process holds the lock file
    exclusively (another holder would make it wait); outside, the benchmarker is what it was."""
    import fcntl

    from torch._inductor.runtime import benchmarking

    lock = tmp_path / "tactics" / compile_workers.TIMING_LOCK
    held: list[bool] = []

    def fake_timing(*args: object, **kwargs: object) -> float:
        with open(lock, "a") as other:  # a second open file: flock conflicts with the wrapper's own
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held.append(True)
            else:
                held.append(False)
                fcntl.flock(other, fcntl.LOCK_UN)
        return 1.0

    bench = benchmarking.benchmarker
    monkeypatch.setattr(bench, "benchmark_gpu", fake_timing)
    with compile_workers.timing_alone(lock):
        assert bench.benchmark_gpu(lambda: None) == 1.0
    assert bench.benchmark_gpu(lambda: None) == 1.0
    assert held == [True, False]
    assert bench.benchmark_gpu is fake_timing
