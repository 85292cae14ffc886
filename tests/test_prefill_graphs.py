"""PrefillGraphs' bookkeeping on the CPU, with CUDA's graph API stood in for: what a replay reads and
writes, which shapes it keeps, and when it calls the package directly. The capture itself is a GPU test."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from trtbuild.backends import prefill_graphs
from trtbuild.backends.prefill_graphs import PrefillGraphs

_capturing: list[Any] = []


class _Graph:
    """Records the work a package call would launch while capturing; replay runs it again."""

    def __init__(self) -> None:
        self.work: Any = None

    def replay(self) -> None:
        self.work()

    def pool(self) -> str:
        return "pool"


@contextlib.contextmanager
def _graph(graph: _Graph, pool: Any = None) -> Iterator[None]:
    _capturing.append(graph)
    yield
    _capturing.pop()


class _Stream:
    def wait_stream(self, other: Any) -> None:
        pass


class _Package:
    """A prefill that answers each row's last token + its prompt length, as the graphs' greedy tokens."""

    graph_safe = True

    def __init__(self) -> None:
        self.direct_calls = 0

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = torch.empty(tokens.shape[0], 1, dtype=torch.long)

        def work() -> None:
            out.copy_(tokens[:, -1:] + positions[-1] + 1)

        if _capturing:
            _capturing[-1].work = work  # captured: launched by replays only
        else:
            self.direct_calls += 1
            work()
        return out


@pytest.fixture()
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph", _graph)
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(prefill_graphs, "sync", lambda device: None)


def _run(graphs: PrefillGraphs, rows: list[list[int]]) -> list[int]:
    tokens, positions = torch.tensor(rows), torch.arange(len(rows[0]))
    graphs.prepare(tokens, positions)
    return graphs(tokens, positions)[:, 0].tolist()


def test_a_replay_reads_each_new_prompt_and_keeps_the_most_recent_shapes(fake_cuda: None) -> None:
    package = _Package()
    graphs = PrefillGraphs(package, "cuda:0", limit=2)
    assert _run(graphs, [[1, 2, 3]]) == [6] and package.direct_calls == 1  # the warm-up call before the capture
    assert graphs.last_replayed
    assert _run(graphs, [[1, 2, 7]]) == [10] and package.direct_calls == 1  # same shape: the prompt copied in
    assert _run(graphs, [[4, 5], [6, 8]]) == [7, 10]
    assert _run(graphs, [[9, 9, 9]]) == [12]  # (1, 3) used last, so (2, 2) is the oldest
    _run(graphs, [[1, 1, 1, 1]])
    assert graphs.report() == {"on": True, "replayed": True, "shapes": [[1, 3], [1, 4]], "limit": 2}
    assert package.direct_calls == 3  # one warm-up per capture, every prefill itself a replay


def test_positions_live_with_their_graph_not_with_the_call_that_captured_it(fake_cuda: None) -> None:
    """The graph reads its positions at the address it captured: a copy it owns, not the caller's tensor."""
    package = _Package()
    graphs = PrefillGraphs(package, "cuda:0", limit=1)
    tokens, positions = torch.tensor([[1, 2, 3]]), torch.arange(3)
    graphs.prepare(tokens, positions)
    positions.fill_(100)  # the caller's tensor reused for something else
    assert graphs(tokens, torch.arange(3))[:, 0].tolist() == [6]


@pytest.mark.parametrize(("limit", "device", "why"), [(0, "cuda:0", "off (TRTBUILD_PREFILL_GRAPHS=N turns it on)"),
                                                      (2, "cpu", "no CUDA device")])
def test_without_graphs_every_prefill_calls_the_package_and_the_report_says_why(limit: int, device: str,
                                                                               why: str) -> None:
    package = _Package()
    graphs = PrefillGraphs(package, device, limit)
    assert _run(graphs, [[1, 2, 3]]) == [6] and _run(graphs, [[1, 2, 3]]) == [6]
    assert package.direct_calls == 2 and not graphs.last_replayed
    assert graphs.report() == {"on": False, "why": why}
