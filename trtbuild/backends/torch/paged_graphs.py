"""Paged decode steps as CUDA graphs: one graph a row-count bucket, captured by a server before it is ready
(`capture_all`), or else the first time a step needs it.

A decode step of the paged graph is dozens of kernels a layer for a few rows: launched one by one from the
host, the launches, not the kernels, set its time. A captured graph replays them in one launch. A graph fixes
its inputs' shapes and addresses, so each bucket has static buffers, filled by one host-to-device copy a
step: the tokens and positions (rows, 1) and the block tables (rows, the blocks of a full-length sequence).
A step of n rows runs the smallest bucket that holds them; the bucket's other rows are padding, at
position 0 with every table entry the pool's scratch block, a block no sequence is handed, so what they write
and read touches no sequence. A real row's table is padded with the scratch block too: attention reads no
slot past the row's position. Buckets are the powers of two up to the most rows a step can have, the
paged graph's limit (export.PAGED_ROWS) or the pool's capacity (a sequence holds at least one block).

Off CUDA (and for a package that cannot be captured) the same padded buffers run the package directly, which
is what the CPU tests check the padding with.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

from trtbuild.errors import InputError
from trtbuild.timing import sync


def buckets(max_rows: int) -> list[int]:
    """The row counts graphs are captured for: powers of two, the last the first that holds `max_rows`."""
    out = [1]
    while out[-1] < max_rows:
        out.append(out[-1] * 2)
    return out


def bucket_for(rows: int, sizes: list[int]) -> int:
    for size in sizes:
        if size >= rows:
            return size
    raise InputError(f"a decode step of {rows} rows is past the paged graphs' {sizes[-1]}")


def _even(n: int) -> int:
    # each buffer segment starts on a 16-byte boundary: the compiled graph copies an input that is not aligned
    # into an aligned tensor on every call (DecodeGraphs measured that at batch 1)
    return -(-n // 2) * 2


class PagedDecodeGraphs:
    """Static buffers and, on CUDA, a captured graph for each row-count bucket of the paged decode step."""

    def __init__(self, package: Any, pools: list[Any], device: str, width: int, scratch: int, max_rows: int) -> None:
        self.package, self.pools, self.device = package, pools, device
        self.width, self.scratch = width, scratch  # table entries a row (a full-length sequence's blocks)
        self.sizes = buckets(max_rows)
        self.capturable = device.startswith("cuda") and getattr(package, "graph_safe", True)
        self.io: dict[int, Any] = {}  # bucket -> one buffer holding its tokens, positions and tables
        self.host: dict[int, Any] = {}  # bucket -> the same on the host
        self.inputs: dict[int, tuple[Any, Any, Any]] = {}
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Any, Any]] = {}  # each graph's (greedy, logits): a replay writes there
        self._pool: Any = None  # the graphs share one memory pool: they never run at the same time

    def _buffers(self, size: int) -> tuple[Any, Any, Any]:
        import torch

        if size not in self.inputs:
            seg = _even(size)
            io = torch.zeros(2 * seg + _even(size * self.width), dtype=torch.long, device=self.device)
            self.io[size] = io
            # on CUDA the host side is pinned, so the step's one copy is asynchronous; it is refilled only after
            # the step before has been read back (its tokens), so after that step's copy is done
            self.host[size] = torch.zeros(io.shape, dtype=torch.long, pin_memory=self.capturable)
            self.inputs[size] = (io[:size].view(size, 1), io[seg:seg + size].view(size, 1),
                                 io[2 * seg:2 * seg + size * self.width].view(size, self.width))
        return self.inputs[size]

    def host_rows(self, size: int, blocks: list[list[int]], tokens: list[int], positions: list[int]) -> Any:
        """The bucket's buffer as the host fills it: the rows' tokens, positions and tables, then padding rows
        (token 0 at position 0, every table entry the scratch block). Every entry must be a block of the pool
        (below the scratch block). Written through numpy: at 256 rows the step's host work is a cost the GPU
        waits for (torch ops on small host tensors took 2.2 ms a step on a 2-core host, this 0.7)."""
        import numpy as np

        self._buffers(size)
        n, seg, host = len(tokens), _even(size), self.host[size].numpy()
        lengths = np.fromiter(map(len, blocks), dtype=np.int64, count=n)
        if n and int(lengths.max()) > self.width:
            raise InputError(f"a block table is wider than a full-length sequence's {self.width} blocks")
        flat = np.fromiter(chain.from_iterable(blocks), dtype=np.int64, count=int(lengths.sum()))
        if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= self.scratch):
            raise InputError(f"a block table names a block outside the pool's {self.scratch}")
        host[:n] = tokens
        host[n:seg] = 0
        host[seg:seg + n] = positions
        host[seg + n:2 * seg] = 0
        tables = host[2 * seg:2 * seg + size * self.width].reshape(size, self.width)
        tables.fill(self.scratch)
        # every row's entries at once: the entries before each row's length, in row order, are its table's
        tables[:n][np.arange(self.width)[None, :] < lengths[:, None]] = flat
        return self.host[size]

    def run(self, blocks: list[list[int]], tokens: list[int], positions: list[int]) -> tuple[Any, Any]:
        """One decode step of the rows (each row's block table, token and position): greedy (n, 1) and
        logits (n, V), views of the bucket's output buffers, valid until the next step."""
        import torch

        size = bucket_for(len(tokens), self.sizes)
        tok, pos, tables = self._buffers(size)
        if self.capturable and size not in self.graphs:
            self._capture(size)
        self.io[size].copy_(self.host_rows(size, blocks, tokens, positions), non_blocking=self.capturable)
        n = len(tokens)
        if size in self.graphs:
            self.graphs[size].replay()
            greedy, logits = self.outputs[size]
        else:
            with torch.no_grad():
                greedy, logits = self.package(tok, pos, tables, *self.pools)
        return greedy[:n], logits[:n]

    def capture_all(self) -> None:
        """Capture every bucket's graph now (CUDA; nothing elsewhere), so that no request's step pays a capture:
        a server does this before it says it is ready."""
        for size in self.sizes:
            if self.capturable and size not in self.graphs:
                self._capture(size)

    def _capture(self, size: int) -> None:
        """Warm up and capture the bucket's step with every row a padding row: the warm-up and the capture write
        only the scratch block, so a capture may come between any two steps of a server."""
        import torch

        tok, pos, tables = self._buffers(size)
        tok.zero_()
        pos.zero_()
        tables.fill_(self.scratch)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        # the first calls allocate and load kernels: kept out of the graph
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(2):
                self.package(tok, pos, tables, *self.pools)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool), torch.no_grad():
            self.outputs[size] = self.package(tok, pos, tables, *self.pools)
        self._pool = graph.pool()
        self.graphs[size] = graph
        sync(self.device)
