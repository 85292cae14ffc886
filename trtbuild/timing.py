"""Honest clocks: CUDA events on a GPU, perf_counter after a synchronize elsewhere.

Device work is asynchronous; a host clock read without a sync measures the launch, not the work.
`StepClock` records one mark per step without stalling the device (events), and reads the
intervals once, after one synchronize, at the end.
"""

from __future__ import annotations

import contextlib
import os
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


# p99 this many times p50 or more: the samples measured the machine's other work, not the engine's
UNSTABLE_RATIO = 2.0


def free_cores() -> tuple[int, str]:
    """The threads a CPU run should use: the cores this process may run on less those already busy (the 1-minute
    load average), at least one; and the sentence that says so. More threads than free cores make every step
    wait for the slowest, preempted one: the tail (p99) grows many times the median."""
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    n = max(1, min(allowed, int(allowed - load + 0.5)))
    return n, f"{allowed} core(s) this process may use, {load:.1f} busy (1-minute load average)"


_WANTED_THREADS: list[int] = []  # what `use_threads` chose, for `apply_threads` once torch is imported


def use_threads(threads: int | None) -> dict[str, Any]:
    """Choose torch's intra-op threads before any work: `threads`, or what `free_cores` allows. Applied at once
    where torch is imported already, else by `apply_threads` when the build's start-up imports it (so that the
    report's start-up phase keeps the import's seconds). Returns what the report prints: {"threads", "why"}."""
    if threads is None:
        n, why = free_cores()
        why = f"default: {why}; --threads to choose"
    else:
        n, why = threads, "--threads"
    _WANTED_THREADS[:] = [n]
    apply_threads()
    return {"threads": n, "why": why}


def apply_threads() -> None:
    """Set the threads `use_threads` chose, if it chose any and torch is imported (a no-op otherwise)."""
    import sys

    torch = sys.modules.get("torch")
    if _WANTED_THREADS and torch is not None and hasattr(torch, "set_num_threads"):
        torch.set_num_threads(_WANTED_THREADS[0])


def unstable(samples: dict[str, float]) -> str | None:
    """A sentence when a percentile dict's p99 is far above its p50 (figures that measured the machine's load)."""
    if samples.get("p50", 0.0) > 0 and samples.get("p99", 0.0) >= UNSTABLE_RATIO * samples["p50"]:
        return (f"p99 is {samples['p99'] / samples['p50']:.1f}x p50: the figures are unstable (other work on the "
                "machine, or more threads than free cores); measure again on a quiet machine or with fewer --threads")
    return None


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
