"""Captured prefill graphs: a short prompt's first token without the host launching every kernel.

Why: a prefill of 128 tokens is bound by reading the weights once (bench.py's floors), yet on the H100
the 1B engine took 2.8 ms for it against a 0.84 ms floor (RESULTS.md, twenty-fifth session, call 71),
and on the H200 1.66 ms against ~0.6. A 1B layer's weights arrive in ~20 us, while the host launches
its dozen kernels one by one through AOTInductor's runner: the GPU waits on the host. The decode steps
never had that wait (each is one graph replay, decode_graphs.DecodeGraphs); this gives the prefill the
same, one graph per (batch bucket, prompt length), since a graph holds its shapes.

Off by default (`TRTBUILD_PREFILL_GRAPHS=N` keeps up to N graphs, least recently used dropped first):
so far it has run on an H100 only with the test models (its GPU test passed, and a tiny model's prefill
took 56-64% less time, RESULTS.md call 73), not at 1B or 8B; each graph keeps its memory, and a failed
capture poisons the process (shared/reference's H200 notes). Each graph is captured before the
prefill it serves, outside the timed interval, as the decode graphs are (`prepare`); a shape met for
the first time pays one extra prefill and the capture there.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from trtbuild.errors import InputError
from trtbuild.timing import sync


@dataclass
class _Captured:
    graph: Any  # torch.cuda.CUDAGraph
    tokens: Any  # the static input the replay reads: each prompt is copied in first
    positions: Any  # 0..t-1, kept alive here: the graph reads it at its address
    out: Any  # the static output the replay writes (greedy token ids)


class PrefillGraphs:
    """The prefill package, called directly or through a captured graph of the call's shape."""

    def __init__(self, package: Any, device: str, limit: int) -> None:
        self.package, self.device, self.limit = package, device, limit
        # run_single_threaded packages only (torch_runtime._Model.graph_safe): others fail capture
        self.capturable = limit > 0 and device.startswith("cuda") and getattr(package, "graph_safe", True)
        self.graphs: OrderedDict[tuple[int, int], _Captured] = OrderedDict()
        # One memory pool for every prefill graph: they never run at the same time, and what a replay leaves
        # behind (its `out`, perhaps where another graph keeps its scratch) is read before the next prefill.
        self._pool: Any = None
        self.last_replayed = False

    def report(self) -> dict[str, Any]:
        """For the run report: whether the prefill replays a graph, and why not where it does not."""
        if not self.capturable:
            why = ("off (TRTBUILD_PREFILL_GRAPHS=N turns it on)" if self.limit <= 0 else
                   "no CUDA device" if not self.device.startswith("cuda") else
                   "the package was not loaded single-threaded")
            return {"on": False, "why": why}
        return {"on": True, "replayed": self.last_replayed, "shapes": [list(k) for k in self.graphs],
                "limit": self.limit}

    def prepare(self, tokens: Any, positions: Any) -> None:
        """Capture the graph for this shape if there is none; before the timed prefill. The warm-up call and
        the capture write the cache's first len(positions) slots, which the prefill then overwrites."""
        if not self.capturable:
            return
        key = tuple(tokens.shape)
        if key in self.graphs:
            self.graphs.move_to_end(key)
            return
        import torch

        static, pos = tokens.clone(), positions.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad():  # allocations and kernel loads stay out of the graph
            self.package(static, pos)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool), torch.no_grad():
            out = self.package(static, pos)
        self._pool = graph.pool()
        sync(self.device)
        self.graphs[key] = _Captured(graph, static, pos, out)
        while len(self.graphs) > self.limit:
            self.graphs.popitem(last=False)

    def __call__(self, tokens: Any, positions: Any) -> Any:
        """The prefill's greedy tokens: a replay where `prepare` captured this shape, else a direct call.
        Positions are always 0..t-1 (generate's), so the graph's own copy of them serves."""
        captured = self.graphs.get(tuple(tokens.shape))
        self.last_replayed = captured is not None
        if captured is None:
            return self.package(tokens, positions)
        captured.tokens.copy_(tokens)
        captured.graph.replay()
        return captured.out


def prefill_graph_limit() -> int:
    """TRTBUILD_PREFILL_GRAPHS=N: keep up to N captured prefill graphs (one per batch bucket and prompt
    length); unset or 0, none, until it is measured at 1B and 8B (prefill_graphs.py)."""
    raw = os.environ.get("TRTBUILD_PREFILL_GRAPHS", "").strip() or "0"
    if not raw.isdigit() or int(raw) > 64:
        raise InputError(f"TRTBUILD_PREFILL_GRAPHS: expected a number of graphs from 0 to 64, got {raw!r}")
    return int(raw)
