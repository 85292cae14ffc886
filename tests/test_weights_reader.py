"""The threaded safetensors reader (TRTBUILD_LOAD_THREADS): the same tensors as safetensors' own
loader, and a clear error for a damaged file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trtbuild.backends.torch.weights_reader import load_threads
from trtbuild.backends.torch.weights_reader import contiguous_groups, read_safetensors
from trtbuild.errors import InputError, TrtbuildError


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_threaded_read_gives_the_same_tensors_as_safetensors(weights: Path, threads: int) -> None:
    want = load_file(str(weights))
    got = read_safetensors(weights, "cpu", threads=threads, chunk_bytes=1000)
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name


def test_each_thread_reads_one_contiguous_range_of_about_equal_size() -> None:
    jobs = [(offset, 100, None, 0) for offset in range(0, 1000, 100)]
    groups = contiguous_groups(list(reversed(jobs)), 3)
    assert [len(g) for g in groups] == [4, 3, 3]
    assert [j[0] for g in groups for j in g] == sorted(j[0] for j in jobs)
    assert contiguous_groups([], 4) == []


def test_a_truncated_or_garbled_file_is_a_clear_error_naming_it(weights: Path) -> None:
    data = weights.read_bytes()
    weights.write_bytes(data[:-100])
    with pytest.raises(TrtbuildError, match="weights.safetensors.*past the end of the file"):
        read_safetensors(weights, "cpu", threads=2)
    weights.write_bytes(b"\xff" * 64)
    with pytest.raises(TrtbuildError, match="weights.safetensors: not a readable safetensors file"):
        read_safetensors(weights, "cpu")


def test_load_threads_comes_from_the_environment_and_refuses_nonsense(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRTBUILD_LOAD_THREADS", raising=False)
    assert (load_threads("cuda:0"), load_threads("cpu")) == (8, 0)  # threaded by default where it was measured
    monkeypatch.setenv("TRTBUILD_LOAD_THREADS", "6")
    assert (load_threads("cuda:0"), load_threads("cpu")) == (6, 6)
    monkeypatch.setenv("TRTBUILD_LOAD_THREADS", "0")
    assert load_threads("cuda:0") == 0
    monkeypatch.setenv("TRTBUILD_LOAD_THREADS", "many")
    with pytest.raises(InputError, match="TRTBUILD_LOAD_THREADS"):
        load_threads("cuda:0")
