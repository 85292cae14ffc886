"""The paged graphs at run time: the block pools, sized by memory, and the calls `trtbuild serve` makes through
them (a prompt chunk from any start position; a decode step of any rows; both in one call of the mixed step).
The engine's paged slot API over them is paged_slots.PagedSlots. See models/paged.py for the layout.

The pools are the graph's inputs, allocated here once: on CUDA `fraction` of the device memory left free
after the weights, the row caches and the graphs are loaded; on the CPU `fraction` of the memory available,
at most what 256 sequences of the engine's full length fill. The pool holds at least one full-length
sequence, or the server refuses to start (a smaller pool could never finish a long request).
"""

from __future__ import annotations

import os
from itertools import chain
from typing import Any, Callable

from trtbuild.errors import InputError

CPU_SEQUENCES = 256  # a CPU pool's cap, in sequences of the engine's full length


def pool_blocks(cfg: Any, elem: int, device: str, max_seq_len: int, fraction: float, blocks: int | None) -> int:
    """How many blocks the pools get: `blocks` where given, else by memory (see the module's docstring)."""
    from trtbuild.models.paged import BLOCK

    per_block = 2 * cfg.num_layers * cfg.num_kv_heads * BLOCK * cfg.head_dim * elem
    full = -(-max_seq_len // BLOCK)
    if blocks is None:
        if device.startswith("cuda"):
            import torch

            free, _ = torch.cuda.mem_get_info(device)
            blocks = int(free * fraction) // per_block
        else:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            blocks = min(int(available * fraction) // per_block, CPU_SEQUENCES * full)
    if blocks < full:
        raise InputError(f"the KV pool would hold {blocks} blocks of {BLOCK} tokens, fewer than one sequence of the "
                         f"engine's max_seq_len {max_seq_len} needs ({full})",
                         hint="raise --kv-memory, free device memory, or serve with --kv-cache rows")
    return blocks


ALIGN = 2  # int64 entries: 16 bytes, the alignment AOTInductor compiles a graph's inputs for


class Uploads:
    """A call's int64 inputs on the device, from one host-to-device copy: each input starts 16-byte aligned (a
    graph given a view off that alignment copies it first, every call, with a warning) and is contiguous.

    On CUDA the host side is one of a ring of pinned buffers and the copy is asynchronous: a copy from pageable
    memory synchronizes the stream, so the host would wait for the step in flight before it could launch the
    next one, and the device would then wait for the host's launches. A buffer is refilled once its last copy
    has run, `RING` calls later (a launched step makes two: its fed rows' indices and its inputs; its copies run
    once the step before it has, and that step is read back before the next launch). On the CPU the inputs are
    the host array itself."""

    RING = 4

    def __init__(self, device: str) -> None:
        self.device, self.cuda = device, device.startswith("cuda")
        self._ring: list[tuple[Any, Any]] = [(None, None)] * self.RING  # (pinned buffer, event after its copy)
        self._turn = 0

    def __call__(self, *parts: Any) -> list[Any]:
        """The numpy arrays `parts` as device tensors of their shapes, in order."""
        import numpy as np
        import torch

        offsets, total = [], 0
        for a in parts:
            offsets.append(total)
            total += -(-a.size // ALIGN) * ALIGN
        if not self.cuda:
            buf = np.empty(max(total, 1), dtype=np.int64)
        else:
            slot = self._turn % self.RING
            self._turn += 1
            host, copied = self._ring[slot]
            if copied is not None:
                copied.synchronize()
            if host is None or host.numel() < total:  # grown by doubling: pinning memory takes milliseconds
                host = torch.empty(max(total, 2 * (0 if host is None else host.numel()), 4096), dtype=torch.long,
                                   pin_memory=True)
            buf = host.numpy()
        for a, o in zip(parts, offsets):
            buf[o:o + a.size] = a.reshape(-1)
        if self.cuda:
            data = torch.empty(total, dtype=torch.long, device=self.device)
            data.copy_(host[:total], non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            self._ring[slot] = (host, done)
        else:
            data = torch.from_numpy(buf)
        return [data[o:o + a.size].view(a.shape) for a, o in zip(parts, offsets)]


class PagedCache:
    """The pools and the paged package; calls return the graph's (greedy (B, 1), logits (B, V)).

    The pools hold one block more than `num_blocks`, the scratch block, never handed to a sequence: the padding
    rows of a decode step's CUDA graph (paged_graphs.py) write and read it. On CUDA, decode steps replay those
    graphs where the graph attends through the paged kernel (`graphs` False: every step calls the package
    directly, as on the CPU)."""

    def __init__(self, package: Any, cfg: Any, num_blocks: int, dtype: Any, device: str, max_seq_len: int,
                 graphs: bool = True, max_input_len: int | None = None, mixed: Any = None) -> None:
        import torch

        from trtbuild.backends.torch.export import PAGED_ROWS
        from trtbuild.backends.torch.mixed_graphs import PagedMixedGraphs
        from trtbuild.backends.torch.paged_graphs import PagedChunkGraphs, PagedDecodeGraphs
        from trtbuild.models.families import token_matmul_flops
        from trtbuild.models.llama import paged_kernel
        from trtbuild.models.paged import BLOCK, pool_shape

        self.package, self.device, self.num_blocks, self.block_size = package, device, num_blocks, BLOCK
        self.mixed_package = mixed  # the mixed step (models/paged.MixedStep), where the engine has it
        self.max_seq_len = max_seq_len
        self.max_blocks = -(-max_seq_len // BLOCK)
        self.scratch = num_blocks
        self.upload = Uploads(device)
        self.pools = [torch.zeros(pool_shape(cfg, num_blocks + 1), dtype=dtype, device=device)
                      for _ in range(2 * cfg.num_layers)]
        # Only where the graph attends through the paged kernel, which reads each row's filled slots whatever
        # its table's width: the ATen gather reads every entry, so tables padded to a full-length sequence would
        # make every step read max_seq_len slots a row. Tables of 2+ entries, as the graph was exported for.
        self.graphs: PagedDecodeGraphs | None = None
        self.chunks: PagedChunkGraphs | None = None  # small prompt-chunk calls, captured likewise
        self.mixed_graphs: PagedMixedGraphs | None = None  # the mixed step's launched calls, captured likewise
        if graphs and paged_kernel(cfg, self.pools[0]):
            self.graphs = PagedDecodeGraphs(package, self.pools, device, max(2, self.max_blocks), self.scratch,
                                            min(PAGED_ROWS, num_blocks))
            self.chunks = PagedChunkGraphs(package, self.pools, device, max(2, self.max_blocks), self.scratch,
                                           max_seq_len, max_input_len or max_seq_len, BLOCK)
            if mixed is not None:
                self.mixed_graphs = PagedMixedGraphs(mixed, self.pools, device, max(2, self.max_blocks), self.scratch,
                                                     max_seq_len, min(PAGED_ROWS, num_blocks),
                                                     max_input_len or max_seq_len, BLOCK, token_matmul_flops(cfg))

    def _table(self, blocks: list[int], width: int) -> list[int]:
        if len(blocks) < width or any(not 0 <= b < self.num_blocks for b in blocks[:width]):
            raise InputError(f"a block table of {len(blocks)} blocks does not cover {width} blocks of the pool's "
                             f"{self.num_blocks}")
        # at least two entries (the second a repeat, masked as past every position): the graph was exported
        # for tables of 2 or more blocks, as a width of 1 specializes export's shapes (a runtime assert)
        return blocks[:width] + blocks[:1] * (2 - width)

    def prefill(self, blocks: list[int], tokens: list[int], start: int) -> tuple[Any, Any]:
        import numpy as np
        import torch

        if self.chunks is not None and (out := self.chunks.run([blocks], [tokens], [start])) is not None:
            return out
        end = start + len(tokens)
        table = self._table(blocks, -(-end // self.block_size))
        # one host-to-device copy for the three inputs: each torch call gives the GIL up and takes it back, which
        # under a busy event loop costs the engine thread a wait (serving/server.py's SWITCH_INTERVAL_S)
        inputs = self.upload(np.asarray([tokens], dtype=np.int64), np.arange(start, end, dtype=np.int64)[None],
                             np.asarray([table], dtype=np.int64))
        with torch.no_grad():
            return self.package(*inputs, *self.pools)

    def prefill_many(self, blocks: list[list[int]], tokens: list[list[int]], starts: list[int]) -> tuple[Any, Any]:
        """Several requests' prompt chunks in one call, row i chunk tokens[i] at positions starts[i].. through
        blocks[i]: (greedy (n, 1), logits (n, V)) of each chunk's last token. The rows are left-padded to the
        longest chunk (paged_graphs.left_padded); a row whose padding would pass the engine's max_seq_len is
        called alone instead."""
        import torch

        if self.chunks is not None and (out := self.chunks.run(blocks, tokens, starts)) is not None:
            return out
        alone = self._chunk_rows(blocks, tokens, starts)
        if isinstance(alone, list):  # the rare row near the end of the engine's length: the others still go together
            return self._prefill_some(blocks, tokens, starts, alone)
        with torch.no_grad():
            return self.package(*self.upload(*alone), *self.pools)  # one copy (see `prefill`)

    def _chunk_rows(self, blocks: list[list[int]], tokens: list[list[int]], starts: list[int],
                    least: int = 1) -> tuple[Any, Any, Any] | list[int]:
        """Chunks as the rows of one call, each left-padded to the longest (and to `least` tokens): int64 arrays
        of the tokens (n, longest), positions (n, longest) and tables (n, width), or the rows whose padding would
        pass the engine's max_seq_len (they cannot go in one call with the others)."""
        import numpy as np

        from trtbuild.backends.torch.paged_graphs import left_padded

        bs, longest = self.block_size, max(least, *map(len, tokens))
        rows: list[tuple[list[int], list[int], list[int]]] = []  # (tokens, positions, table) of each padded row
        alone: list[int] = []
        for i, (b, chunk, start) in enumerate(zip(blocks, tokens, starts)):
            row = left_padded(chunk, start, longest, bs, self.max_seq_len)
            if row is None:
                alone.append(i)
                continue
            padded, positions, owned = row
            # the row's own blocks, then scratch entries for the padding (never `_table`'s repeated first block
            # for a row of one block: the padding's positions would land in it)
            table = self._table(b, owned)[:owned] + [self.scratch] * -(-(longest - len(chunk)) // bs)
            rows.append((padded, positions, table))
        if alone:
            return alone
        width = max(2, max(len(r[2]) for r in rows))  # the graph was exported for tables of 2+ entries
        return (np.asarray([t for t, _, _ in rows], dtype=np.int64), np.asarray([p for _, p, _ in rows], dtype=np.int64),
                np.asarray([table + [self.scratch] * (width - len(table)) for _, _, table in rows], dtype=np.int64))

    def _prefill_some(self, blocks: list[list[int]], tokens: list[list[int]], starts: list[int],
                      alone: list[int]) -> tuple[Any, Any]:
        import torch

        rest = [i for i in range(len(tokens)) if i not in alone]
        outs: dict[int, tuple[Any, Any]] = {}
        if rest:
            g, lg = self.prefill_many([blocks[i] for i in rest], [tokens[i] for i in rest], [starts[i] for i in rest])
            outs |= {i: (g[j:j + 1], lg[j:j + 1]) for j, i in enumerate(rest)}
        for i in alone:
            outs[i] = self.prefill(blocks[i], tokens[i], starts[i])
        order = [outs[i] for i in range(len(tokens))]
        return torch.cat([g for g, _ in order]), torch.cat([lg for _, lg in order])

    def decode(self, blocks: list[list[int]], tokens: list[int], positions: list[int],
               feed: Callable[[Any], None] | None = None) -> tuple[Any, Any]:
        """One decode step: greedy (n, 1) and logits (n, V). `feed`, where given, writes tokens the device
        already holds (the step before's) into the rows' token column (n,) once it is on the device."""
        import torch

        if self.graphs is not None:  # the entries are checked as the bucket's buffer is filled
            from trtbuild.backends.torch.paged_graphs import through_positions

            return self.graphs.run(through_positions(blocks, positions, self.block_size), tokens, positions, feed)
        inputs = self.upload(*self._decode_rows(blocks, tokens, positions))
        if feed is not None:
            feed(inputs[0][:, 0])
        with torch.no_grad():
            return self.package(*inputs, *self.pools)

    def _decode_rows(self, blocks: list[list[int]], tokens: list[int], positions: list[int]) -> tuple[Any, Any, Any]:
        """The decode rows' inputs as int64 arrays, tokens (n, 1), positions (n, 1) and tables (n, width):
        each table through its row's position, padded to the widest (2 at least) with the row's own first block
        (attention masks past each row's position). Through numpy: at 64 rows of 900 tokens, built from Python
        lists it took 0.49 ms of host time a step (0.60 with a 512-token chunk, the mixed step), now 0.09 (0.15),
        which the device waits for (2-core host, 2026-12-07, benchmarks/probes/paged_inputs_probe.py)."""
        import numpy as np

        n, bs = len(tokens), self.block_size
        pos = np.asarray(positions, dtype=np.int64)
        need = (pos + bs) // bs  # the blocks through each row's position
        have = np.fromiter(map(len, blocks), dtype=np.int64, count=n)
        short = np.flatnonzero(have < need)
        if short.size:
            i = int(short[0])
            raise InputError(f"a block table of {have[i]} blocks does not cover {need[i]} blocks of the pool's "
                             f"{self.num_blocks}")
        width = max(2, int(need.max()))
        flat = np.fromiter(chain.from_iterable(b[:k] for b, k in zip(blocks, need.tolist())), dtype=np.int64,
                           count=int(need.sum()))
        if int(flat.min()) < 0 or int(flat.max()) >= self.num_blocks:
            raise InputError(f"a block table names a block outside the pool's {self.num_blocks}")
        tables = np.empty((n, width), dtype=np.int64)
        tables[:] = np.fromiter((b[0] for b in blocks), dtype=np.int64, count=n)[:, None]
        tables[np.arange(width)[None, :] < need[:, None]] = flat
        return np.asarray(tokens, dtype=np.int64)[:, None], pos[:, None], tables

    def mixed(self, dec_blocks: list[list[int]], dec_tokens: list[int], positions: list[int],
              blocks: list[list[int]], tokens: list[list[int]], starts: list[int],
              feed: Callable[[Any], None] | None = None) -> tuple[Any, Any] | None:
        """A decode step of rows (tables, tokens, positions, `feed` as `decode`) and prompt chunks (as
        `prefill_many`) in one call of the mixed step: greedy (Bd + Bc, 1) and logits (Bd + Bc, V), the decode
        rows' first. None where the engine has no mixed step or a chunk's padding would pass the engine's
        length: the caller then makes the two calls."""
        import torch

        if self.mixed_package is None:
            return None
        # chunk rows of 2+ tokens: the mixed step was exported for them (a row of one token specializes export's
        # shapes: the graph asserts Tc != 1)
        chunks = self._chunk_rows(blocks, tokens, starts, least=2)
        if isinstance(chunks, list):
            return None
        inputs = self.upload(*self._decode_rows(dec_blocks, dec_tokens, positions), *chunks)  # one copy
        if feed is not None:
            feed(inputs[0][:, 0])
        with torch.no_grad():
            return self.mixed_package(*inputs, *self.pools)
