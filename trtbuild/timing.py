"""Honest clocks: CUDA events on a GPU, perf_counter after a synchronize elsewhere.

Device work is asynchronous; a host clock read without a sync measures the launch, not the work.
`StepClock` records one mark per step without stalling the device (events), and reads the
intervals once, after one synchronize, at the end.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from itertools import pairwise
from typing import Any


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


class StepClock:
    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self._marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        """Seconds between consecutive marks."""
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in pairwise(self._marks)]
        return [b - a for a, b in pairwise(self._marks)]


@contextlib.contextmanager
def phase(phases: dict[str, float], name: str, device: str = "cpu") -> Iterator[None]:
    """Time a host-visible phase (load, warm-up), synchronizing the device before both readings."""
    sync(device)
    t = time.perf_counter()
    try:
        yield
    finally:
        sync(device)
        phases[name] = phases.get(name, 0.0) + time.perf_counter() - t


def percentiles(samples: list[float]) -> dict[str, float]:
    """p50/p90/p99 (nearest-rank on the sorted samples) and the mean; empty input gives zeros."""
    if not samples:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0}
    s = sorted(samples)

    def rank(q: float) -> float:
        return s[min(len(s) - 1, max(0, int(round(q * len(s) + 0.5)) - 1))]

    return {"p50": statistics.median(s), "p90": rank(0.90), "p99": rank(0.99), "mean": statistics.fmean(s)}


def graph_seconds(calls: Callable[[], object], reps: int = 15) -> float:
    """Seconds per replay of one CUDA graph holding `calls`: the median of `reps` event-timed replays.

    In a graph, as in the engine's decode, there is no launch overhead between kernels; outside one,
    Python's ~20 us per launch would hide a 2 us matmul."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls()  # compiles and warms outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    for _ in range(3):
        graph.replay()
    return event_seconds(graph.replay, reps)


def event_seconds(run: Callable[[], object], reps: int) -> float:
    """Seconds of one `run`: the median (the upper one for an even `reps`) of `reps` runs, each between two
    CUDA events. CUDA only."""
    import torch

    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]
