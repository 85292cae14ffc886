"""A decode bucket's step as CUDA graphs: the whole step replayed on the device, one graph a cache window.

Each replay does the step on the device (forward and argmax in the compiled graph, write the token,
advance the positions), so a token costs one replay and no host work beyond picking the graph: one per
cache window (`decode_windows`), since attention reads only as many cache slots as the window holds.
Every row has its own position and its own cache row (`slots`): `generate`'s loop feeds the graph its own
tokens (`start`, `step`), a server's scheduler hands it any set of rows each step (`run`).
"""

from __future__ import annotations

from typing import Any

from trtbuild.errors import InputError
from trtbuild.timing import sync


def decode_windows(max_seq_len: int) -> list[int]:
    """Cache spans the decode graphs are run (and captured) at: max_seq_len and up to five halvings,
    none under 16 slots. A step runs the smallest that covers its position, so attention reads at
    most twice the filled cache (and never less than a 32nd of it) instead of all of it."""
    return sorted({max_seq_len >> k for k in range(6) if max_seq_len >> k >= 16} | {max_seq_len})


def windows_between(windows: list[int], first: int, last: int) -> list[int]:
    """The windows that decode positions first..last-1 run in (window w serves the positions from
    the previous window up to w - 1)."""
    if last <= first:
        return []
    need: list[int] = []
    lower = 0
    for w in windows:
        if lower < last and w > first:
            need.append(w)
        lower = w
    return need


class DecodeGraphs:
    """One decode bucket: static buffers, and on CUDA one captured graph of the whole step per
    cache window (the graphs share one memory pool: they never run at the same time)."""

    def __init__(self, package: Any, batch: int, max_seq_len: int, device: str,
                 pdl_on: dict[str, Any] | None = None, scratch: int | None = None) -> None:
        import torch

        self.package, self.device, self.batch = package, device, batch
        # The graph's three inputs are rows of one buffer, so that a step of the slot API fills them in one
        # copy. Each row starts on a 16-byte boundary (an even number of int64 columns): the compiled graphs
        # assume 16-byte aligned inputs and copy any input that is not into an aligned tensor on every call
        # (at batch 1 an 8-byte row put the positions off by 8 bytes, and each step paid that copy).
        self.io = torch.zeros(3, -(-batch // 2) * 2, dtype=torch.long, device=device)
        self.tok = self.io[0, :batch].view(batch, 1)
        self.pos = self.io[1, :batch].view(batch, 1)  # each row's position
        self.slots = self.io[2, :batch]  # each row's cache row
        self.own_rows = torch.arange(batch, device=device)  # generate's rows: row i in cache row i
        self.slots.copy_(self.own_rows)
        # the cache row that padding rows and the capture's warm-up steps write (llama.scratch_row)
        self.scratch = batch if scratch is None else scratch
        self.out = torch.zeros(batch, max_seq_len, dtype=torch.long, device=device)
        self.logits: Any = None  # the last step's logits (B, V): the graph's output buffer when captured
        self.windows = decode_windows(max_seq_len)
        self.spans = {w: torch.arange(w, device=device) for w in self.windows}
        self.next_pos = 0  # the position the next step writes, mirrored on the host to pick a window
        self.capturable = device.startswith("cuda") and getattr(package, "graph_safe", True)
        self.graphs: dict[int, Any] = {}
        # each captured graph's logits buffer, kept referenced so that the shared pool never hands its memory
        # to another graph: a replay writes there
        self.graph_logits: dict[int, Any] = {}
        self._pool: Any = None
        self.pdl = pdl_on or {"on": False, "why": "not asked for"}
        self.pdl_report: dict[str, Any] = dict(self.pdl)

    def window_for(self, pos: int) -> int:
        for w in self.windows:
            if w > pos:
                return w
        raise InputError(f"decode position {pos} is past the engine's max_seq_len {self.windows[-1]}")

    def prepare(self, first: int, last: int) -> None:
        """Capture the graphs of the windows that positions first..last-1 will decode in, if not yet
        captured: a generation captures only what it needs (a restart's first token, no decode step,
        captures nothing; on the H200 all six windows of a bucket took ~0.4 s to capture). The warm-up
        steps and the capture write only the scratch cache row (and `out`), so a capture may come between
        any two steps."""
        if not self.capturable:
            return
        need = [w for w in windows_between(self.windows, first, last) if w not in self.graphs]
        if need:
            self._capture(need)

    def _step(self, window: int) -> None:
        nxt, self.logits = self.package(self.tok, self.pos, self.slots, self.spans[window])  # (B, 1) greedy ids, (B, V)
        self.out.scatter_(1, self.pos, nxt)
        self.tok.copy_(nxt)
        self.pos.add_(1)

    def _capture(self, windows: list[int]) -> None:
        import torch

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        # The first calls allocate and load kernels: keep that out of the graphs (twice, the first time).
        warmups = windows if self.graphs else [windows[0], *windows]
        saved = self.slots.clone()
        self.slots.fill_(self.scratch)  # the warm-up steps and the capture write no sequence's cache
        with torch.cuda.stream(stream), torch.no_grad():
            for w in warmups:
                self.pos.zero_()
                self._step(w)
        torch.cuda.current_stream().wait_stream(stream)
        for w in windows:
            self.graphs[w] = self._capture_one(w)
        self.slots.copy_(saved)
        sync(self.device)

    def _capture_one(self, window: int) -> Any:
        import torch

        # keep_graph: a PDL graph is edited (its edges) before it is instantiated
        graph = torch.cuda.CUDAGraph(keep_graph=True) if self.pdl["on"] else torch.cuda.CUDAGraph()
        self.pos.zero_()
        with torch.cuda.graph(graph, pool=self._pool), torch.no_grad():
            self._step(window)
        self.graph_logits[window] = self.logits
        self._pool = graph.pool()
        if self.pdl["on"]:
            from trtbuild.backends.torch import pdl

            try:
                self.pdl_report = self.pdl | pdl.overlap(graph.raw_cuda_graph(), self.pdl["inductor"],
                                                         trtbuild_wait=self.pdl["trtbuild"])
            except OSError as e:  # a driver that refuses the edit: this graph may be half edited, so capture anew
                self.pdl = self.pdl_report = {"on": False, "why": f"the driver refused the PDL edges: {e}"}
                return self._capture_one(window)
            graph.instantiate()
        return graph

    def start(self, first: Any, prompt_len: int) -> None:
        """Seed the loop with prefill's token for position prompt_len - 1, every row in its own cache row."""
        self.tok.copy_(first[:, None])
        self.slots.copy_(self.own_rows)  # a copy, no allocation: this runs inside the timed prefill
        self.pos.fill_(prompt_len - 1)
        self.out.scatter_(1, self.pos, self.tok)
        self.pos.fill_(prompt_len)
        self.next_pos = prompt_len

    def step(self) -> None:
        window = self.window_for(self.next_pos)
        graph = self.graphs.get(window)
        if graph is not None:
            graph.replay()
            self.logits = self.graph_logits[window]
        else:  # the CPU, or a window not prepared (correct, only slower)
            self._step(window)
        self.next_pos += 1

    def run(self, rows: Any, last: int) -> tuple[Any, Any]:
        """One step of any rows: `rows` (3, B) int64 holds each row's token, its position (the position of the
        token fed) and its cache row, padding rows included (the caller points them at the scratch row);
        `last` is the largest position among them. Returns the greedy tokens (B,) and the logits (B, V), both
        the graph's buffers (read them before the next step)."""
        window = self.window_for(last)
        if self.capturable and window not in self.graphs:
            self._capture([window])
        self.io[:, : self.batch].copy_(rows)
        graph = self.graphs.get(window)
        if graph is not None:
            graph.replay()
            self.logits = self.graph_logits[window]
        else:
            self._step(window)
        return self.tok[:, 0], self.logits
