"""The host's time to build a paged call's inputs, with no graph behind it: a direct decode step of R rows and
a mixed step (those rows and one prompt chunk), on the CPU.

    python3 benchmarks/probes/paged_inputs_probe.py [--rows 64] [--context 900] [--chunk 512] [--iters 200]

A server's engine thread builds these between two device calls, and the device waits for it. The package is a
stand-in that returns at once, so the median is the input building and the host-to-device copy alone (a copy
to the CPU here). Prints one line a call kind.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # trtbuild, run from a checkout

from trtbuild.backends.torch.paged_runtime import PagedCache  # noqa: E402


def median_ms(fn: Any, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, default=900, help="each decode row's position")
    ap.add_argument("--chunk", type=int, default=512, help="the mixed step's chunk tokens")
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    block = 16
    per_row = -(-(args.context + 1) // block)
    chunk_blocks = -(-(1024 + args.chunk) // block)
    total = args.rows * per_row + chunk_blocks
    cache = PagedCache.__new__(PagedCache)  # the pools and packages are not needed to build inputs
    cache.block_size, cache.num_blocks, cache.scratch, cache.max_seq_len, cache.device = block, total, total, 4096, "cpu"
    cache.pools, cache.graphs, cache.chunks = [], None, None
    cache.package = cache.mixed_package = lambda *inputs: inputs
    tables = [list(range(i * per_row, (i + 1) * per_row)) for i in range(args.rows)]
    tokens, positions = [1] * args.rows, [args.context] * args.rows
    chunk_table = list(range(args.rows * per_row, total))
    chunk = list(range(args.chunk))
    decode = median_ms(lambda: cache.decode(tables, tokens, positions), args.iters)
    mixed = median_ms(lambda: cache.mixed(tables, tokens, positions, [chunk_table], [chunk], [1024]), args.iters)
    print(f"decode step, {args.rows} rows at {args.context}: {decode:.3f} ms of host time (median of {args.iters})")
    print(f"mixed step, those rows and a {args.chunk}-token chunk after 1024: {mixed:.3f} ms")


if __name__ == "__main__":
    main()
