"""What one dependency costs inside a captured decode step: a kernel boundary (serialized, or with
programmatic dependent launch) against a grid-wide barrier inside one persistent kernel.

Why: the fourteenth session (RESULTS.md) found the excess over the floor to be ~27 us a layer at both
the 1B and the 8B shape, and the 8B batch-1 step to be 326 kernels in one chain. If most of that is
the boundaries between kernels, a kernel that runs a whole layer (one launch, its steps separated by
barriers) would remove it; if a barrier costs about what a boundary does, it would not. This probe
measures that before any such kernel is written. In one CUDA graph per case, a chain of `links`
dependent steps over one program per SM; each step reads another program's block of the previous
step's output (so each truly depends on the whole step before) and writes its own:
  - serial:  one small kernel per step, full edges (what a captured graph gives by default);
  - pdl:     the same kernels, waiting with griddepcontrol.wait and releasing after their load, with
             every edge made programmatic (as the engine's decode graphs do for trtbuild's kernels);
  - barrier: one kernel doing every step, a grid-wide barrier (an atomic counter) between steps.
The cost per link is the slope between two chain lengths, so the graph's own launch and the
barrier's counter reset drop out. Each case's result is checked against the expected values first.
Needs CUDA and Triton (sm_90 for pdl).

    python benchmarks/chain_probe.py --links 32,320 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from trtbuild.models.grid_dependency import release_successor, wait_for_predecessor  # noqa: E402


@triton.jit
def _chain_link(x_ptr, y_ptr, programs, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One step: block pid of y = block (pid + 1) % programs of x, plus one."""
    if PDL:
        z = wait_for_predecessor()
        x_ptr, y_ptr = x_ptr + z, y_ptr + z
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    v = tl.load(x_ptr + ((pid + 1) % programs) * BLOCK + offs)
    if PDL:
        v = release_successor(v)
    tl.store(y_ptr + pid * BLOCK + offs, v + 1.0)


@triton.jit
def _chain_persistent(buf_ptr, count_ptr, programs, links, BLOCK: tl.constexpr):
    """Every step in one launch: the buffer holds both halves of the ping-pong ([2, programs, BLOCK]), and
    a barrier on count_ptr (zeroed before the launch) separates the steps. Needs every program resident
    at once (one per SM), or it never finishes."""
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    for i in range(links):
        src = (i % 2) * programs * BLOCK
        dst = ((i + 1) % 2) * programs * BLOCK
        # .cg: the block was written by another SM, and L1 is not coherent across SMs
        v = tl.load(buf_ptr + src + ((pid + 1) % programs) * BLOCK + offs, cache_modifier=".cg")
        tl.store(buf_ptr + dst + pid * BLOCK + offs, v + 1.0, cache_modifier=".cg")
        # the barrier, as a grid sync does it: every thread's stores ordered before one thread's release
        tl.debug_barrier()
        tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")
        target = (i + 1) * programs
        while tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu") < target:
            pass
        tl.debug_barrier()


def expected(start: torch.Tensor, links: int) -> torch.Tensor:
    """What `links` steps leave from `start` ([P, BLOCK]): block p is start's block (p + links) % P plus links."""
    return torch.roll(start, -links, dims=0) + links


def run_links(a: torch.Tensor, b: torch.Tensor, links: int, pdl: bool) -> torch.Tensor:
    """`links` launches of the step kernel, ping-ponging between a and b; returns the last one written."""
    p, block = a.shape
    for i in range(links):
        x, y = (a, b) if i % 2 == 0 else (b, a)
        _chain_link[(p,)](x, y, p, BLOCK=block, PDL=pdl, num_warps=4)
    return b if links % 2 else a


def _replay_seconds(calls: Callable[[], object], programmatic: bool, reps: int) -> tuple[float, int]:
    """Seconds per replay of a graph of `calls` (its edges made programmatic first when asked), and the
    number of edges made so."""
    from trtbuild.backends.pdl import Driver
    from trtbuild.timing import event_seconds

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        calls()
    edges = 0
    if programmatic:
        drv, raw = Driver(), graph.raw_cuda_graph()
        names = {n: name for n in drv.nodes(raw) if (name := drv.kernel_name(n)) is not None}
        chosen = [e for e in drv.edges(raw) if e.kind == 0 and e.from_port == 0 and e.src in names and e.dst in names]
        drv.make_programmatic(raw, chosen)
        edges = len(chosen)
    graph.instantiate()
    for _ in range(3):
        graph.replay()
    return event_seconds(graph.replay, reps), edges


def measure(case: str, links: int, programs: int, block: int, reps: int) -> dict[str, Any]:
    """One case at one chain length: checked once from a known start, then timed in a graph."""
    start = torch.arange(programs * block, device="cuda", dtype=torch.float32).reshape(programs, block)
    buf = torch.empty(2, programs, block, device="cuda", dtype=torch.float32)
    count = torch.zeros(1, device="cuda", dtype=torch.int32)

    def calls() -> torch.Tensor:
        if case == "barrier":
            count.zero_()
            _chain_persistent[(programs,)](buf, count, programs, links, BLOCK=block, num_warps=4)
            return buf[links % 2]
        return run_links(buf[0], buf[1], links, pdl=case == "pdl")

    buf[0].copy_(start)
    got = calls()
    torch.cuda.synchronize()
    correct = bool(torch.equal(got, expected(start, links)))
    seconds, edges = _replay_seconds(calls, case == "pdl", reps)
    return {"case": case, "links": links, "us": seconds * 1e6, "correct": correct, "programmatic_edges": edges}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--links", default="32,320", help="two chain lengths; the cost per link is the slope between them")
    ap.add_argument("--block", type=int, default=256, help="fp32 elements each program reads and writes a step")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    short, long = sorted(int(n) for n in args.links.split(","))
    programs = torch.cuda.get_device_properties(0).multi_processor_count  # one per SM: all resident
    t0 = time.perf_counter()
    rows = []
    for case in ("serial", "pdl", "barrier"):
        runs = [measure(case, n, programs, args.block, args.reps) for n in (short, long)]
        slope = (runs[1]["us"] - runs[0]["us"]) / (long - short)
        rows.append({"case": case, "us_per_link": slope, "runs": runs, "correct": all(r["correct"] for r in runs)})
    print(f"device {torch.cuda.get_device_name(0)}, {programs} programs x {args.block} fp32 a step, links {short} and {long}")
    print(f"{'case':10} {'us/link':>8} {'us@' + str(short):>10} {'us@' + str(long):>10}  result")
    for r in rows:
        print(f"{r['case']:10} {r['us_per_link']:8.3f} {r['runs'][0]['us']:10.1f} {r['runs'][1]['us']:10.1f}  "
              f"{'correct' if r['correct'] else 'WRONG'}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "programs": programs,
              "block": args.block, "rows": rows, "seconds": time.perf_counter() - t0}
    (Path(args.out) / "chain-probe.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
