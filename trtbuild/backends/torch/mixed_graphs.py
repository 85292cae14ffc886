"""The mixed paged step (models/paged.MixedStep: a step's decode rows and its prompt chunks in one call) as CUDA
graphs, one a (decode rows, chunk rows, chunk tokens) bucket, captured by a server before it is ready.

Called directly, the mixed step is ~300 kernels launched one by one from the host. A 1B model's step runs
them in ~4.5 ms, and the launches take longer than that once the host is busy: on an H100, 64 decode rows and a
512-token chunk took 5.9 ms alone and 8.8 ms with a thread holding the GIL as a loaded server's event loop
does, against 4.5 ms of kernels (2026-12-07, benchmarks/paged_probe.py). Replayed from a graph, the launches
are one. A graph fixes its shapes: the decode rows are padded to a power of two from 16 (a padding row costs a
row of each matmul and attends one position of the scratch block), the chunks to a (rows, tokens) bucket of
paged_graphs.chunk_buckets, as the chunk graphs pad them. A padded token costs a token's matmul FLOPs, which
in a large model outweigh the launches saved: a call takes a graph only where the FLOPs its bucket adds to the
direct call (whose chunk rows are padded to the longest) take at most `SAVED_S` at `MATMUL_FLOPS_PER_S`; a 1B
model may add ~600 tokens, an 8B ~85. Padding rows and tokens write only the pool's scratch block, as in
paged_graphs.

Only the greedy tokens are kept from a replay: a launched step (PagedSlots.launch_paged) wants nothing else,
and keeping each graph's logits (rows x vocabulary) would hold memory the KV pool could use. A step whose rows
sample calls the mixed step directly.
"""

from __future__ import annotations

from typing import Any, Callable

from trtbuild.backends.torch.paged_graphs import buckets, capture, chunk_buckets, even, fill_chunk_rows, \
    fill_decode_rows, refill, through_positions

LEAST_ROWS = 16  # the smallest decode bucket: fewer rows are padded to it (a step with chunks is not bound by them)
LEAST_TOKENS = 32  # the shortest chunk bucket: a shorter chunk is padded to it
# What a replayed graph saves: the direct call's launch gaps, measured on an H100 (2026-12-07, paged_probe.py, a
# 64-row decode step and a 512-token chunk): 1.4 ms (1B) and 0.6 ms (8B) beyond the kernels' time with the host
# idle, 4.3 and 3.6 ms with a thread holding the GIL as a loaded server's event loop does. And what a padded
# token costs: its matmul FLOPs at the rate an 8B step's chunk matmuls ran there (~680 TFLOP/s), rounded down.
SAVED_S = 0.002
MATMUL_FLOPS_PER_S = 600e12


def mixed_buckets(max_rows: int, max_input_len: int) -> list[tuple[int, int, int]]:
    """The (decode rows, chunk rows, chunk tokens) shapes mixed graphs are captured for."""
    rows = buckets(max_rows)
    rows = [r for r in rows if r >= min(LEAST_ROWS, rows[-1])]
    chunks = chunk_buckets(max_input_len)
    least = min(LEAST_TOKENS, max((t for _, t in chunks), default=0))  # an engine of short prompts keeps its widest
    chunks = [(r, t) for r, t in chunks if t >= least]
    return [(d, r, t) for d in rows for r, t in chunks]


class PagedMixedGraphs:
    """Static buffers and, on CUDA, a captured graph for each bucket of the mixed step. A bucket's buffer holds
    the decode rows' tokens, positions and tables (PagedDecodeGraphs' layout), then the chunk rows' (the
    PagedChunkGraphs layout), each segment 16-byte aligned; tables are a full-length sequence's width."""

    def __init__(self, package: Any, pools: list[Any], device: str, width: int, scratch: int, max_seq_len: int,
                 max_rows: int, max_input_len: int, block: int, token_flops: float) -> None:
        self.package, self.pools, self.device = package, pools, device
        self.most_padding = int(SAVED_S * MATMUL_FLOPS_PER_S / token_flops)  # tokens a graph may add to a call
        self.width, self.scratch, self.max_seq_len, self.block = width, scratch, max_seq_len, block
        self.sizes = mixed_buckets(max_rows, max_input_len)
        self.capturable = device.startswith("cuda") and getattr(package, "graph_safe", True)
        self.io: dict[tuple[int, int, int], Any] = {}
        self.host: dict[tuple[int, int, int], Any] = {}
        self.inputs: dict[tuple[int, int, int], tuple[Any, ...]] = {}
        self.graphs: dict[tuple[int, int, int], Any] = {}
        self.outputs: dict[tuple[int, int, int], Any] = {}  # each graph's greedy tokens (Bd + Bc, 1)
        self.copied: dict[tuple[int, int, int], Any] = {}  # bucket -> a CUDA event after its last copy
        self._pool: Any = None

    def bucket(self, rows: int, chunk_rows: int, longest: int) -> tuple[int, int, int] | None:
        """The smallest bucket that holds the call and whose chunk padding is allowed (see the module), or None."""
        direct = rows + chunk_rows * max(2, longest)
        for d, r, t in self.sizes:
            if d >= rows and r >= chunk_rows and t >= longest:
                return (d, r, t) if d + r * t - direct <= self.most_padding else None
        return None

    def _segments(self, size: tuple[int, int, int]) -> list[tuple[int, tuple[int, ...]]]:
        """(offset, shape) of each input in the bucket's buffer: decode tokens, positions, tables; chunk tokens,
        positions, tables."""
        d, r, t = size
        shapes = [(d, 1), (d, 1), (d, self.width), (r, t), (r, t), (r, self.width)]
        out, offset = [], 0
        for shape in shapes:
            out.append((offset, shape))
            offset += even(shape[0] * shape[1])
        return out

    def _buffers(self, size: tuple[int, int, int]) -> tuple[Any, ...]:
        import torch

        if size not in self.inputs:
            segments = self._segments(size)
            end = segments[-1][0] + even(segments[-1][1][0] * segments[-1][1][1])
            io = torch.zeros(end, dtype=torch.long, device=self.device)
            self.io[size] = io
            self.host[size] = torch.zeros(io.shape, dtype=torch.long, pin_memory=self.capturable)
            self.inputs[size] = tuple(io[o:o + s[0] * s[1]].view(*s) for o, s in segments)
        return self.inputs[size]

    def host_rows(self, size: tuple[int, int, int], blocks: list[list[int]], tokens: list[int],
                  positions: list[int], cblocks: list[list[int]], ctokens: list[list[int]],
                  starts: list[int]) -> Any | None:
        """The bucket's buffer as the host fills it (paged_graphs.fill_decode_rows, then fill_chunk_rows), or
        None where a chunk row's padding would pass the engine's length."""
        self._buffers(size)
        host = self.host[size].numpy()
        views = [host[o:o + s[0] * s[1]].reshape(s) for o, s in self._segments(size)]
        fill_decode_rows(*views[:3], blocks, tokens, positions, self.scratch)
        ok = fill_chunk_rows(*views[3:], cblocks, ctokens, starts, self.scratch, self.block, self.max_seq_len)
        return self.host[size] if ok else None

    def run(self, blocks: list[list[int]], tokens: list[int], positions: list[int], cblocks: list[list[int]],
            ctokens: list[list[int]], starts: list[int], feed: Callable[[Any], None] | None = None) -> Any | None:
        """A decode step of rows (each row's table, token and position) and prompt chunks (as
        PagedCache.prefill_many) through their bucket: the greedy tokens (Bd + Bc, 1), the decode rows' first,
        or None where no bucket takes the call. `feed` as PagedDecodeGraphs.run."""
        import torch

        n, m = len(tokens), len(ctokens)
        size = self.bucket(n, m, max(map(len, ctokens)))
        if size is None:
            return None
        blocks = through_positions(blocks, positions, self.block)
        inputs = self._buffers(size)
        if self.capturable and size not in self.graphs:
            self._capture(size)
        if not refill(self, size, lambda: self.host_rows(size, blocks, tokens, positions, cblocks, ctokens, starts)):
            return None
        if feed is not None:
            feed(inputs[0][:n, 0])
        if size in self.graphs:
            self.graphs[size].replay()
            greedy = self.outputs[size]
        else:
            with torch.no_grad():
                greedy, _ = self.package(*inputs, *self.pools)
        d = size[0]
        return torch.cat([greedy[:n], greedy[d:d + m]])

    def capture_all(self) -> None:
        """Capture every bucket's graph now (CUDA; nothing elsewhere)."""
        for size in self.sizes:
            if self.capturable and size not in self.graphs:
                self._capture(size)

    def _capture(self, size: tuple[int, int, int]) -> None:
        """Every row a padding row, so that only the scratch block is written; the logits are let go (see the
        module)."""
        import torch

        dtok, dpos, dtab, ctok, cpos, ctab = self._buffers(size)
        for x in (dtok, dpos, ctok):
            x.zero_()
        cpos.copy_(torch.arange(size[2], device=cpos.device).expand(size[1], size[2]))
        dtab.fill_(self.scratch)
        ctab.fill_(self.scratch)
        graph, (greedy, _), self._pool = capture(self.package, (*self._buffers(size), *self.pools), self._pool,
                                                 self.device)
        self.graphs[size], self.outputs[size] = graph, greedy
