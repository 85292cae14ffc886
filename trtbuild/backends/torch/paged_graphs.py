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
from typing import Any, Callable

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


def even(n: int) -> int:
    """`n` int64 entries rounded up to an even count: each buffer segment then starts on a 16-byte boundary (the
    compiled graph copies an input that is not aligned into an aligned tensor on every call; DecodeGraphs
    measured that at batch 1)."""
    return -(-n // 2) * 2


def capture(package: Any, inputs: tuple[Any, ...], pool: Any, device: str) -> tuple[Any, Any, Any]:
    """A CUDA graph of `package(*inputs)` in memory pool `pool` (None: a new one): (graph, its outputs, the pool).
    Two calls first on a side stream, outside the graph: they allocate and load the kernels."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(2):
            package(*inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool), torch.no_grad():
        outputs = package(*inputs)
    sync(device)
    return graph, outputs, graph.pool()


def through_positions(blocks: list[list[int]], positions: list[int], block: int) -> list[list[int]]:
    """Each decode row's table through the block that holds its position (a captured bucket's rows: the rest of
    the table is the scratch block); InputError where a table does not reach its row's position."""
    rows = [b[:(p + block) // block] for b, p in zip(blocks, positions)]
    short = next((i for i, (r, p) in enumerate(zip(rows, positions)) if len(r) * block <= p), None)
    if short is not None:
        raise InputError(f"row {short}'s block table of {len(blocks[short])} blocks does not reach its "
                         f"position {positions[short]}")
    return rows


def refill(graphs: Any, size: Any, fill: Callable[[], Any | None]) -> bool:
    """Refill a bucket's device inputs from its pinned host buffer, which `fill` writes and returns (None: the
    call cannot go in this bucket; nothing is copied, False). The bucket's last copy may still be queued behind
    a step not yet read back (or a chunk call not waited for), so the host buffer is written only once that copy
    has run; this copy is asynchronous on CUDA, an event marking its end. `graphs`: the bucket's owner, with
    `io`, `copied` and `capturable` (PagedDecodeGraphs, PagedChunkGraphs, mixed_graphs.PagedMixedGraphs)."""
    import torch

    if size in graphs.copied:
        graphs.copied[size].synchronize()
    host = fill()
    if host is None:
        return False
    graphs.io[size].copy_(host, non_blocking=graphs.capturable)
    if graphs.capturable:
        graphs.copied[size] = torch.cuda.Event()
        graphs.copied[size].record()
    return True


def left_padded(chunk: list[int], start: int, length: int, block: int,
                max_seq_len: int) -> tuple[list[int], list[int], int] | None:
    """A prompt chunk at positions start.. as one row of a call whose rows hold `length` tokens: (tokens,
    positions, the blocks of its table it owns), or None where the padding would pass max_seq_len (rope's table).
    The row is padded on the left, so that its last column is its own last token (the paged graph's output);
    the padding sits at the positions just past the row's own blocks, whose table entries the caller fills with
    the scratch block, so its keys and values land there and the row's own tokens, which attend only up to their
    positions, never see them."""
    end, pad = start + len(chunk), length - len(chunk)
    owned = -(-end // block)
    if pad and owned * block + pad > max_seq_len:
        return None
    return [0] * pad + chunk, [*range(owned * block, owned * block + pad), *range(start, end)], owned


def fill_decode_rows(tok: Any, pos: Any, tables: Any, blocks: list[list[int]], tokens: list[int],
                     positions: list[int], scratch: int) -> None:
    """A decode step's rows into a bucket's host arrays (numpy views: tokens and positions (size, 1), tables
    (size, width)): the rows, then padding rows (token 0 at position 0, every table entry `scratch`). Every entry
    must be a block of the pool (below the scratch block). Through numpy: at 256 rows the step's host work is a
    cost the GPU waits for (torch ops on small host tensors took 2.2 ms a step on a 2-core host, this 0.7)."""
    import numpy as np

    n, width = len(tokens), tables.shape[1]
    lengths = np.fromiter(map(len, blocks), dtype=np.int64, count=n)
    if n and int(lengths.max()) > width:
        raise InputError(f"a block table is wider than a full-length sequence's {width} blocks")
    flat = np.fromiter(chain.from_iterable(blocks), dtype=np.int64, count=int(lengths.sum()))
    if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= scratch):
        raise InputError(f"a block table names a block outside the pool's {scratch}")
    tok[:n, 0] = tokens
    tok[n:] = 0
    pos[:n, 0] = positions
    pos[n:] = 0
    tables.fill(scratch)
    # every row's entries at once: the entries before each row's length, in row order, are its table's
    tables[:n][np.arange(width)[None, :] < lengths[:, None]] = flat


def fill_chunk_rows(tok: Any, pos: Any, tables: Any, blocks: list[list[int]], tokens: list[list[int]],
                    starts: list[int], scratch: int, block: int, max_seq_len: int) -> bool:
    """Prompt chunks into a bucket's host arrays (numpy views (rows, tokens) and tables (rows, width)), each
    left-padded to the bucket's tokens (`left_padded`), then padding rows (token 0 at positions 0.., every table
    entry `scratch`). False where a row's padding would pass max_seq_len. Every table entry a row owns must be a
    block of the pool (below the scratch block)."""
    import numpy as np

    t = tok.shape[1]
    tables.fill(scratch)
    tok.fill(0)
    pos[:] = np.arange(t)[None, :]
    for i, (b, chunk, start) in enumerate(zip(blocks, tokens, starts)):
        row = left_padded(chunk, start, t, block, max_seq_len)
        if row is None:
            return False
        tok[i], pos[i], owned = row
        if len(b) < owned or any(not 0 <= x < scratch for x in b[:owned]):
            raise InputError(f"a block table of {len(b)} blocks does not cover {owned} blocks of the pool's "
                             f"{scratch}")
        tables[i, :owned] = b[:owned]
    return True


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
        self.copied: dict[int, Any] = {}  # bucket -> a CUDA event after its last host-to-device copy
        self._pool: Any = None  # the graphs share one memory pool: they never run at the same time

    def _buffers(self, size: int) -> tuple[Any, Any, Any]:
        import torch

        if size not in self.inputs:
            seg = even(size)
            io = torch.zeros(2 * seg + even(size * self.width), dtype=torch.long, device=self.device)
            self.io[size] = io
            # on CUDA the host side is pinned, so the step's one copy is asynchronous; `run` refills it once the
            # bucket's last copy is done (a step is launched before the one before it is read back)
            self.host[size] = torch.zeros(io.shape, dtype=torch.long, pin_memory=self.capturable)
            self.inputs[size] = (io[:size].view(size, 1), io[seg:seg + size].view(size, 1),
                                 io[2 * seg:2 * seg + size * self.width].view(size, self.width))
        return self.inputs[size]

    def host_rows(self, size: int, blocks: list[list[int]], tokens: list[int], positions: list[int]) -> Any:
        """The bucket's buffer as the host fills it: the rows' tokens, positions and tables, then padding rows
        (`fill_decode_rows`)."""
        self._buffers(size)
        seg, host = even(size), self.host[size].numpy()
        fill_decode_rows(host[:size, None], host[seg:seg + size, None],
                         host[2 * seg:2 * seg + size * self.width].reshape(size, self.width),
                         blocks, tokens, positions, self.scratch)
        return self.host[size]

    def run(self, blocks: list[list[int]], tokens: list[int], positions: list[int],
            feed: Callable[[Any], None] | None = None) -> tuple[Any, Any]:
        """One decode step of the rows (each row's block table, token and position): greedy (n, 1) and
        logits (n, V), views of the bucket's output buffers, valid until the next step. `feed`, where given,
        writes tokens the device already holds into the rows' token column (n,) before the step runs."""
        import torch

        size = bucket_for(len(tokens), self.sizes)
        tok, pos, tables = self._buffers(size)
        if self.capturable and size not in self.graphs:
            self._capture(size)
        refill(self, size, lambda: self.host_rows(size, blocks, tokens, positions))
        n = len(tokens)
        if feed is not None:
            feed(tok[:n, 0])
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
        tok, pos, tables = self._buffers(size)
        tok.zero_()
        pos.zero_()
        tables.fill_(self.scratch)
        self.graphs[size], self.outputs[size], self._pool = capture(self.package, (tok, pos, tables, *self.pools),
                                                                     self._pool, self.device)


# -- prompt chunks ------------------------------------------------------------------------------------------------
# A step's prompt chunks (one call, a row a request: PagedCache.prefill_many) are captured as well where the call
# is small: its launches then cost more than its kernels (a 1B layer is a dozen kernels whatever the tokens). A
# bucket is (rows, tokens a row), powers of two from 16 tokens, at most CHUNK_TOKENS tokens in all; a larger
# call is bound by its matmuls and runs directly, unpadded (padding it to a bucket would multiply its FLOPs).
CHUNK_ROWS = (1, 2, 4, 8)
CHUNK_TOKENS = 512


def chunk_buckets(max_input_len: int) -> list[tuple[int, int]]:
    """The (rows, tokens) shapes chunk graphs are captured for."""
    out = []
    for rows in CHUNK_ROWS:
        t = 16
        while t <= min(max_input_len, CHUNK_TOKENS // rows):
            out.append((rows, t))
            t *= 2
    return out


class PagedChunkGraphs:
    """Static buffers and, on CUDA, a captured graph for each (rows, tokens) bucket of a step's prompt chunks.

    A bucket's rows are the chunks, each left-padded to the bucket's tokens (`left_padded`), then padding
    rows: token 0 at positions 0.. with every table entry the scratch block. Tables are a full-length sequence's
    width. A call takes the smallest bucket that holds its rows and its longest chunk, if there is one and every
    row's padding stays inside the engine's length; else `run` returns None and the caller calls directly."""

    def __init__(self, package: Any, pools: list[Any], device: str, width: int, scratch: int, max_seq_len: int,
                 max_input_len: int, block: int) -> None:
        self.package, self.pools, self.device = package, pools, device
        self.width, self.scratch, self.max_seq_len, self.block = width, scratch, max_seq_len, block
        self.sizes = chunk_buckets(max_input_len)
        self.capturable = device.startswith("cuda") and getattr(package, "graph_safe", True)
        self.io: dict[tuple[int, int], Any] = {}
        self.host: dict[tuple[int, int], Any] = {}
        self.inputs: dict[tuple[int, int], tuple[Any, Any, Any]] = {}
        self.graphs: dict[tuple[int, int], Any] = {}
        self.outputs: dict[tuple[int, int], tuple[Any, Any]] = {}
        self.copied: dict[tuple[int, int], Any] = {}  # bucket -> a CUDA event after its last host-to-device copy
        self._pool: Any = None

    def bucket(self, rows: int, tokens: int) -> tuple[int, int] | None:
        return next(((r, t) for r, t in self.sizes if r >= rows and t >= tokens), None)

    def _buffers(self, size: tuple[int, int]) -> tuple[Any, Any, Any]:
        import torch

        if size not in self.inputs:
            rows, t = size
            seg, tab = even(rows * t), even(rows * self.width)
            io = torch.zeros(2 * seg + tab, dtype=torch.long, device=self.device)
            self.io[size] = io
            self.host[size] = torch.zeros(io.shape, dtype=torch.long, pin_memory=self.capturable)
            self.inputs[size] = (io[:rows * t].view(rows, t), io[seg:seg + rows * t].view(rows, t),
                                 io[2 * seg:2 * seg + rows * self.width].view(rows, self.width))
        return self.inputs[size]

    def host_rows(self, size: tuple[int, int], blocks: list[list[int]], tokens: list[list[int]],
                  starts: list[int]) -> Any | None:
        """The bucket's buffer as the host fills it, or None where a row's padding would pass the engine's
        length. Every table entry a row owns must be a block of the pool (below the scratch block)."""
        rows, t = size
        self._buffers(size)
        seg, host = even(rows * t), self.host[size].numpy()
        ok = fill_chunk_rows(host[:rows * t].reshape(rows, t), host[seg:seg + rows * t].reshape(rows, t),
                             host[2 * seg:2 * seg + rows * self.width].reshape(rows, self.width),
                             blocks, tokens, starts, self.scratch, self.block, self.max_seq_len)
        return self.host[size] if ok else None

    def run(self, blocks: list[list[int]], tokens: list[list[int]], starts: list[int]) -> tuple[Any, Any] | None:
        """The chunks through their bucket: greedy (n, 1) and logits (n, V) of each chunk's last token (views of
        the bucket's outputs, valid until its next call), or None where no bucket takes the call."""
        import torch

        size = self.bucket(len(tokens), max(map(len, tokens)))
        if size is None:
            return None
        tok, pos, tables = self._buffers(size)
        if self.capturable and size not in self.graphs:
            self._capture(size)
        if not refill(self, size, lambda: self.host_rows(size, blocks, tokens, starts)):
            return None
        n = len(tokens)
        if size in self.graphs:
            self.graphs[size].replay()
            greedy, logits = self.outputs[size]
        else:
            with torch.no_grad():
                greedy, logits = self.package(tok, pos, tables, *self.pools)
        return greedy[:n], logits[:n]

    def capture_all(self) -> None:
        """Capture every bucket's graph now (CUDA; nothing elsewhere)."""
        for size in self.sizes:
            if self.capturable and size not in self.graphs:
                self._capture(size)

    def _capture(self, size: tuple[int, int]) -> None:
        """As PagedDecodeGraphs._capture: every row a padding row, so only the scratch block is written."""
        import torch

        tok, pos, tables = self._buffers(size)
        tok.zero_()
        pos.copy_(torch.arange(size[1], device=pos.device).expand(size[0], size[1]))
        tables.fill_(self.scratch)
        self.graphs[size], self.outputs[size], self._pool = capture(self.package, (tok, pos, tables, *self.pools),
                                                                     self._pool, self.device)
