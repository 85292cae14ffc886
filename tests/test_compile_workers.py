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


def test_auto_on_cuda_needs_four_cores_and_memory_for_each_workers_copy_of_the_model(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(compile_workers.ENV, raising=False)
    monkeypatch.setattr(compile_workers.os, "cpu_count", lambda: 2)
    assert compile_workers.worker_count(3, 1, "cuda") == 0
    monkeypatch.setattr(compile_workers.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(compile_workers, "_free_device_bytes", lambda device: 100 << 30)
    assert compile_workers.worker_count(3, 1 << 30, "cuda") == 2
    assert compile_workers.worker_count(3, 60 << 30, "cuda") == 1  # 80 GiB usable holds one 60 GiB copy
    assert compile_workers.worker_count(3, 90 << 30, "cuda") == 0
    assert compile_workers.worker_count(12, 1 << 30, "cuda") == 8  # a worker for two cores


def test_auto_on_the_cpu_forks_up_to_twice_the_cores_with_the_build_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(compile_workers.ENV, raising=False)
    monkeypatch.setattr(compile_workers.os, "cpu_count", lambda: 2)
    assert compile_workers.worker_count(3, 1 << 40, "cpu") == 2  # a fork shares the model: no memory cap
    assert compile_workers.worker_count(8, 1, "cpu") == 3
    assert compile_workers.worker_count(1, 1, "cpu") == 0
    monkeypatch.setattr(compile_workers.os, "cpu_count", lambda: 1)
    assert compile_workers.worker_count(3, 1, "cpu") == 1


def test_a_fork_reports_its_result_and_a_failed_one_its_error(tmp_path: Path) -> None:
    with compile_workers.Forks(tmp_path / "forks") as forks:
        forks.start("good", lambda: {"compile_s": 1.5, "pid": compile_workers.os.getpid()})
        forks.start("bad", lambda: {"x": 1 // 0})
        good, bad = forks.wait("good"), forks.wait("bad")
        assert forks.wait("other") is None
    assert good is not None and good["ok"] and good["compile_s"] == 1.5 and good["total_s"] >= 0
    assert good["pid"] != compile_workers.os.getpid()  # it ran in another process
    assert bad is not None and not bad["ok"] and "ZeroDivisionError" in bad["error"]


def test_a_fork_handed_several_units_reports_each_by_name(tmp_path: Path) -> None:
    with compile_workers.Forks(tmp_path / "forks") as forks:
        forks.start(["a", "b"], lambda: {"a": {"compile_s": 1.0}, "b": {"compile_s": 2.0}})
        assert forks.running["a"] == forks.running["b"]  # one child for both
        a, b = forks.wait("a"), forks.wait("b")
    assert a is not None and a["ok"] and a["compile_s"] == 1.0
    assert b is not None and b["ok"] and b["compile_s"] == 2.0


def test_forks_still_running_are_ended_on_exit(tmp_path: Path) -> None:
    import time

    with compile_workers.Forks(tmp_path / "forks") as forks:
        forks.start("slow", lambda: time.sleep(60) or {})
        pid = forks.running["slow"]
    with pytest.raises(ChildProcessError):
        compile_workers.os.waitpid(pid, 0)  # killed and reaped


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


def test_a_fork_of_a_process_whose_openmp_threads_ran_still_runs_tensor_operations(tmp_path: Path) -> None:
    """libgomp's thread pool does not survive a fork: a child that entered a parallel region would wait for
    the parent's threads forever. A fork of a build that has used them (loading a real model's weights does)
    must still copy tensors."""
    import time

    import torch

    big = torch.ones(1 << 23)
    big.clone()  # large enough to run on every thread: the parent's pool is started
    with compile_workers.Forks(tmp_path / "forks") as forks:
        forks.start("copy", lambda: {"sum": float(big.clone().sum())})
        deadline = time.monotonic() + 60
        while not (tmp_path / "forks" / "copy.result.json").is_file() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (tmp_path / "forks" / "copy.result.json").is_file(), "the fork hung in a tensor copy"
        report = forks.wait("copy")
    assert report is not None and report["ok"] and report["sum"] == float(1 << 23)
