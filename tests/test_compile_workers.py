"""How many worker processes a build compiles its graphs in (the builds themselves: test_build_run.py)."""

from __future__ import annotations

import pytest

from trtbuild.backends import compile_workers
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
