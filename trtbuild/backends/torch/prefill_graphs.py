"""Captured prefill graphs: a short prompt's first token without the host launching every kernel.

Why: a prefill of 128 tokens is bound by reading the weights once (bench.py's floors), yet on the H100
the 1B engine took 2.8 ms for it against a 0.84 ms floor (RESULTS.md, H100, 2026-12-05),
and on the H200 1.66 ms against ~0.6. A 1B layer's weights arrive in ~20 us, while the host launches
its dozen kernels one by one through AOTInductor's runner: the GPU waits on the host. The decode steps
never had that wait (each is one graph replay, decode_graphs.DecodeGraphs); this gives the prefill the
same. A graph holds its shapes, so prompts are padded up to a few lengths (`graph_length`: 16, 32, 64,
then multiples of 64) and one graph serves each (batch bucket, length): a server's prompts of every
length then share a few graphs instead of each new length paying a capture. Padding costs little: under
~200 tokens (1B and 8B on the H200) a prefill is bound by reading the weights, which padding does not
change, and above that at most 63 rows are added. The padding's rows sit at position max_seq_len - 1,
where the model ignores them (llama.prompt_end says why that is exact); the prompt's own rows compute
as they would alone, though a different row count can round a bf16 matmul differently (a near-tie in
the first token may then go the other way, as between batch sizes).

On by default on CUDA, up to DEFAULT_LIMIT graphs (`TRTBUILD_PREFILL_GRAPHS=N` keeps up to N, least recently
used dropped first; 0 turns it off). Without it, a short prompt's prefill is bound by the host: on an H100
(1B, 2026-12-06) 128 tokens took 2.10 ms called directly, with kernels that take ~1.5 ms, and the prefill
attention's choice of kernel had to count each candidate's host cost (prefill_attention.py), which kept
cuDNN's faster kernel out of long prompts too. Each graph keeps memory (the report gives what the captures
added to torch's reserved memory; they share one pool, so it grows with the longest prompt captured, not
with the count: four graphs at 1B reserved 176 MiB), and a failed capture poisons the process (shared
notes on the H200). Each graph is captured before the prefill it serves, outside the timed interval, as
the decode graphs are (`prepare`); a length met for the first time pays one extra prefill and the capture
there.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from trtbuild.errors import InputError
from trtbuild.timing import sync

PAD_STEP = 64  # above 64 tokens, prompts are padded to a multiple of this
# graphs kept where TRTBUILD_PREFILL_GRAPHS is unset: every padded length up to 1024 tokens at one batch size
# (16, 32, 64, 128, ..., 1024 is 19 lengths; a server's random prompts of 256-1024 tokens use 13)
DEFAULT_LIMIT = 16


def graph_length(t: int, longest: int) -> int:
    """The length a prompt of t tokens is padded to: 16, 32, 64, then the next multiple of 64, and never
    past `longest` (the prefill's max_input_len, and at most max_seq_len - 1: see llama.prompt_end)."""
    padded = next((n for n in (16, 32, 64) if t <= n), -(-t // PAD_STEP) * PAD_STEP)
    return max(t, min(longest, padded))


@dataclass
class _Captured:
    graph: Any  # torch.cuda.CUDAGraph
    tokens: Any  # the static input the replay reads: each prompt is copied into its first columns
    positions: Any  # 0..t-1, then the padding's position; the graph reads it at its address
    filled: int  # the prompt length `positions` holds now
    slots: Any  # the cache row of each prompt, copied in before each replay
    out: Any  # the static outputs the replay writes: (greedy token ids, logits)


class PrefillGraphs:
    """The prefill package, called directly or through a captured graph of the call's padded shape."""

    def __init__(self, package: Any, device: str, limit: int, max_input_len: int, max_seq_len: int) -> None:
        self.package, self.device, self.limit = package, device, limit
        self.longest = min(max_input_len, max_seq_len - 1)  # padding rows' indices stay below their position
        self.pad_position = max_seq_len - 1
        # run_single_threaded packages only (graph_runners.Package.graph_safe): others fail capture
        self.capturable = limit > 0 and device.startswith("cuda") and getattr(package, "graph_safe", True)
        self.graphs: OrderedDict[tuple[int, int], _Captured] = OrderedDict()
        # One memory pool for every prefill graph: they never run at the same time, and what a replay leaves
        # behind (its `out`, perhaps where another graph keeps its scratch) is read before the next prefill.
        self._pool: Any = None
        self.reserved_bytes = 0  # what the captures (and their warm-up calls) added to torch's reserved memory
        self.last: tuple[int, int] | None = None  # (prompt length, graph length) of the last replay
        self.failure: str | None = None  # why a capture failed; every prefill is then called directly

    def report(self) -> dict[str, Any]:
        """For the run report: whether the prefill replays a graph, and why not where it does not."""
        if not self.capturable:
            why = (f"a capture failed: {self.failure}" if self.failure else
                   "off (TRTBUILD_PREFILL_GRAPHS=0)" if self.limit <= 0 else
                   "no CUDA device" if not self.device.startswith("cuda") else
                   "the package was not loaded single-threaded")
            return {"on": False, "why": why}
        return {"on": True, "replayed": self.last is not None,
                "lengths": None if self.last is None else {"prompt": self.last[0], "graph": self.last[1]},
                "shapes": [list(k) for k in self.graphs], "limit": self.limit,
                "captures_reserved_mib": round(self.reserved_bytes / 2**20, 1)}

    def _key(self, tokens: Any) -> tuple[int, int]:
        return tokens.shape[0], graph_length(tokens.shape[1], self.longest)

    def prepare(self, tokens: Any, positions: Any, slots: Any) -> None:
        """Capture the graph for this prompt's padded shape if there is none; before the timed prefill. The
        warm-up call and the capture write the cache's first slots, which the prefill then overwrites."""
        if not self.capturable:
            return
        key = self._key(tokens)
        if key in self.graphs:
            self.graphs.move_to_end(key)
            return
        import torch

        before = torch.cuda.memory_reserved(self.device)
        static, pos = tokens.new_zeros(key), positions.new_empty(key[1])  # pos: all of it written by _fill
        captured = _Captured(None, static, pos, -1, slots.clone(), None)
        self._fill(captured, tokens, positions, slots)
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.no_grad():  # allocations and kernel loads stay out of the graph
                self.package(static, pos, captured.slots)
            torch.cuda.current_stream().wait_stream(stream)
            captured.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(captured.graph, pool=self._pool), torch.no_grad():
                captured.out = self.package(static, pos, captured.slots)
        except RuntimeError as e:
            # A prefill that cannot be captured (a kernel that syncs, an allocation a graph refuses) still runs:
            # called directly from here on, with the reason in the report, rather than the request failing.
            self.capturable, self.failure = False, (str(e).splitlines() or [type(e).__name__])[0][:200]
            self.graphs.clear()
            sync(self.device)
            return
        self._pool = captured.graph.pool()
        sync(self.device)
        self.reserved_bytes += max(0, torch.cuda.memory_reserved(self.device) - before)
        self.graphs[key] = captured
        while len(self.graphs) > self.limit:
            self.graphs.popitem(last=False)

    def _fill(self, captured: _Captured, tokens: Any, positions: Any, slots: Any) -> None:
        """Copy the prompt and its cache rows into the graph's input; its positions only where the prompt
        length changed (padding rows keep whatever tokens were there: they are ignored, and any id is in range)."""
        t = tokens.shape[1]
        captured.tokens[:, :t].copy_(tokens)
        captured.slots.copy_(slots)
        if captured.filled != t:
            captured.positions[:t].copy_(positions)
            captured.positions[t:].fill_(self.pad_position)
            captured.filled = t

    def __call__(self, tokens: Any, positions: Any, slots: Any) -> Any:
        """The prefill's (greedy tokens (B, 1), logits (B, V)) for prompts written into cache rows `slots`: a
        replay where `prepare` captured this padded shape, else a direct call with the prompt as it is.
        Positions are always 0..t-1."""
        key = self._key(tokens)
        captured = self.graphs.get(key)
        self.last = None if captured is None else (tokens.shape[1], key[1])
        if captured is None:
            return self.package(tokens, positions, slots)
        self._fill(captured, tokens, positions, slots)
        captured.graph.replay()
        return captured.out


def prefill_graph_limit() -> int:
    """TRTBUILD_PREFILL_GRAPHS=N: keep up to N captured prefill graphs (one per batch bucket and padded prompt
    length); 0, none (every prefill called directly); unset, DEFAULT_LIMIT. CUDA only: elsewhere none."""
    raw = os.environ.get("TRTBUILD_PREFILL_GRAPHS", "").strip() or str(DEFAULT_LIMIT)
    if not raw.isdigit() or int(raw) > 64:
        raise InputError(f"TRTBUILD_PREFILL_GRAPHS: expected a number of graphs from 0 to 64, got {raw!r}")
    return int(raw)
