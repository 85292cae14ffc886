"""PrefillGraphs' bookkeeping on the CPU, with CUDA's graph API stood in for: what a replay reads and
writes, how prompts are padded to the graphs' lengths, which shapes it keeps, and when it calls the
package directly. The capture itself is a GPU test; the model's side of the padding is test_model's."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from trtbuild.backends.torch import prefill_graphs
from trtbuild.backends.torch.prefill_graphs import PrefillGraphs, graph_length

_capturing: list[Any] = []
_reserved = [0]  # torch.cuda.memory_reserved's stand-in: each capture reserves 1 MiB


class _Graph:
    """Records the work a package call would launch while capturing; replay runs it again."""

    def __init__(self) -> None:
        self.work: Any = None
        _reserved[0] += 2**20

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
    """A prefill that answers each row's last prompt token + the prompt's length, as the graphs' greedy
    tokens; the prompt's rows are those at their own position, as in llama.prompt_end."""

    graph_safe = True

    def __init__(self) -> None:
        self.direct_calls = 0

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = torch.empty(tokens.shape[0], 1, dtype=torch.long)

        def work() -> None:
            t = int((positions == torch.arange(len(positions))).sum())
            out.copy_(tokens[:, t - 1 : t] + t)

        if _capturing:
            _capturing[-1].work = work  # captured: launched by replays only
        else:
            self.direct_calls += 1
            work()
        return out, None  # (greedy tokens, logits): the logits are not looked at here


@pytest.fixture()
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph", _graph)
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: _reserved[0])
    monkeypatch.setattr(prefill_graphs, "sync", lambda device: None)


def _run(graphs: PrefillGraphs, rows: list[list[int]]) -> list[int]:
    tokens, positions, slots = torch.tensor(rows), torch.arange(len(rows[0])), torch.arange(len(rows))
    graphs.prepare(tokens, positions, slots)
    return graphs(tokens, positions, slots)[0][:, 0].tolist()


@pytest.mark.parametrize(("t", "longest", "padded"), [(1, 100, 16), (16, 100, 16), (17, 100, 32), (33, 100, 64),
                                                    (64, 100, 64), (65, 300, 128), (129, 300, 192), (70, 100, 100),
                                                    (100, 100, 100), (5, 12, 12)])
def test_prompts_are_padded_to_a_few_graph_lengths_never_past_the_longest(t: int, longest: int, padded: int) -> None:
    assert graph_length(t, longest) == padded


def test_a_replay_reads_each_new_prompt_and_keeps_the_most_recent_shapes(fake_cuda: None) -> None:
    package = _Package()
    graphs = PrefillGraphs(package, "cuda:0", limit=2, max_input_len=100, max_seq_len=200)
    assert _run(graphs, [[1, 2, 3]]) == [6] and package.direct_calls == 1  # the warm-up call before the capture
    assert graphs.report()["lengths"] == {"prompt": 3, "graph": 16}
    assert _run(graphs, [[1, 2, 7]]) == [10] and package.direct_calls == 1  # same shape: the prompt copied in
    assert _run(graphs, [[1, 2, 3, 4, 5]]) == [10] and package.direct_calls == 1  # padded into the same graph
    assert _run(graphs, [[9, 9, 9]]) == [12]  # positions rewritten for the shorter prompt again
    assert _run(graphs, [[4, 5], [6, 8]]) == [7, 10]
    assert _run(graphs, [list(range(40))]) == [39 + 40]  # a new length: (1, 64); (1, 16) is the oldest
    assert graphs.report() == {"on": True, "replayed": True, "lengths": {"prompt": 40, "graph": 64},
                               "shapes": [[2, 16], [1, 64]], "limit": 2, "captures_reserved_mib": 3.0}
    assert package.direct_calls == 3  # one warm-up per capture, every prefill itself a replay


def test_positions_live_with_their_graph_not_with_the_call_that_captured_it(fake_cuda: None) -> None:
    """The graph reads its positions at the address it captured: a copy it owns, not the caller's tensor."""
    package = _Package()
    graphs = PrefillGraphs(package, "cuda:0", limit=1, max_input_len=16, max_seq_len=32)
    tokens, positions = torch.tensor([[1, 2, 3]]), torch.arange(3)
    graphs.prepare(tokens, positions, torch.zeros(1, dtype=torch.long))
    positions.fill_(100)  # the caller's tensor reused for something else
    assert graphs(tokens, torch.arange(3), torch.zeros(1, dtype=torch.long))[0][:, 0].tolist() == [6]


@pytest.mark.parametrize(("limit", "device", "why"), [(0, "cuda:0", "off (TRTBUILD_PREFILL_GRAPHS=0)"),
                                                      (2, "cpu", "no CUDA device")])
def test_without_graphs_every_prefill_calls_the_package_and_the_report_says_why(limit: int, device: str,
                                                                               why: str) -> None:
    package = _Package()
    graphs = PrefillGraphs(package, device, limit, max_input_len=16, max_seq_len=32)
    assert _run(graphs, [[1, 2, 3]]) == [6] and _run(graphs, [[1, 2, 3]]) == [6]
    assert package.direct_calls == 2 and graphs.last is None
    assert graphs.report() == {"on": False, "why": why}


def test_a_failed_capture_leaves_every_prefill_called_directly_and_says_why(fake_cuda: None,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill that cannot be captured still answers: the graphs are dropped, each prompt is called directly,
    and the report names the failure."""
    package = _Package()
    graphs = PrefillGraphs(package, "cuda:0", limit=4, max_input_len=16, max_seq_len=32)
    assert _run(graphs, [[1, 2, 3]]) == [6] and graphs.last is not None  # one shape captured and replayed

    @contextlib.contextmanager
    def refusing(graph: Any, pool: Any = None) -> Iterator[None]:
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")
        yield

    monkeypatch.setattr(torch.cuda, "graph", refusing)
    calls = package.direct_calls
    assert _run(graphs, [list(range(1, 21))]) == [20 + 20]  # a new length: its capture fails
    assert _run(graphs, [[1, 2, 3]]) == [6] and graphs.last is None  # the kept graph dropped too
    assert package.direct_calls == calls + 3  # the failed capture's warm-up, then both prefills directly
    assert graphs.report() == {"on": False, "why": "a capture failed: operation not permitted when stream is capturing"}
