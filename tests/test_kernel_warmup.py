"""Compiling the decode kernels' candidates ahead in worker processes (backends/torch/kernel_warmup.py): it
decides nothing, so a worker that fails must cost the build nothing but the compile it would have saved."""

from __future__ import annotations

import pytest

from trtbuild.backends.torch import kernel_warmup


def test_workers_that_cannot_compile_are_counted_and_nothing_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    """On this CPU host the workers fail at once (no CUDA device to compile for): every task is counted as not
    compiled, the call returns, and the workers' share files are gone with their temporary folder."""
    monkeypatch.setattr(kernel_warmup, "workers_for", lambda tasks: 2)
    messages: list[str] = []
    work = [(1, 64, 128, "none", "torch.bfloat16", ("n4k256w4s1", "n8k256w4s1", "n16k256w4s1")),
            (1, 64, 128, "int4", (((64, 64), "torch.uint8"), ((64, 4), "torch.bfloat16"), None), ("n4k512w4s1",))]
    done = kernel_warmup.precompile(work, "cuda", messages.append)  # type: ignore[arg-type]
    assert done["kernels"] == 0 and done["failed"] == 4 and done["workers"] == 2
    assert messages == ["compiling 4 decode-matmul candidates in 2 processes before timing them"]


def test_nothing_to_compile_or_no_cores_to_spare_starts_no_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_warmup.subprocess, "Popen", None)  # called, it would fail the test
    assert kernel_warmup.precompile([], "cuda", print)["workers"] == 0
    assert kernel_warmup.precompile([(1, 64, 64, "none", "torch.float32", ("a",))], "cpu", print)["workers"] == 0
    monkeypatch.setattr(kernel_warmup, "workers_for", lambda tasks: 1)
    assert kernel_warmup.precompile([(1, 64, 64, "none", "torch.float32", ("a", "b"))], "cuda", print)["workers"] == 0


def test_a_tasks_inputs_survive_the_trip_through_json_as_dict_keys() -> None:
    spec = [[[64, 64], "torch.uint8"], [[64, 4], "torch.bfloat16"], None]
    frozen = kernel_warmup._frozen(spec)
    assert frozen == (((64, 64), "torch.uint8"), ((64, 4), "torch.bfloat16"), None) and hash(frozen)
