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
Then the same three ways for a chain of matrix-vector products, the decode step's real links: link i
multiplies link i-1's output by its own square bf16 matrix (distinct matrices, so none is served from
L2), one kernel's code in all three (`_gemv`: one program per SM, each looping over blocks of rows),
and cuBLAS one launch per link as what the engine's graphs get today. There the boundary also costs
each matmul's ramp and tail, which the persistent kernel may or may not hide.
`--barrier-prefetch-kb` adds `barrier` cases whose programs prefetch the next link's first rows into L2
between arriving at the barrier and waiting at it: a program that has done its share waits there while
the slowest finish theirs, which is when the DRAM may idle; unlike an early-scheduled PDL kernel (below,
measured without gain), its SM has nothing else to run. `--per-sm N` runs N programs per SM with the
engine's narrow configurations, so the persistent kernel has the engine's memory parallelism.
`--prefetch-kb` adds `launch-pdl` cases whose programs, scheduled early under PDL, first issue L2
prefetches (`cp.async.bulk.prefetch.L2`, 4 KB an instruction) of the first KB of their own rows of the
next matrix, then wait: a weight never depends on the previous kernel, so its reads could start in that
kernel's tail, where DRAM idles (the sixteenth session put the 8B step's mid-size matmuls at 3-5 us a
call over their bytes' time; RESULTS.md).
The cost per link is the slope between two chain lengths, so the graph's own launch and the
barrier's counter reset drop out. Each case's result is checked before it is timed. Needs CUDA and
Triton (sm_90 for pdl). Every case that waits on a barrier needs all its programs resident: run it
under `timeout`.

    timeout 120 python benchmarks/chain_probe.py --links 32,320 --gemv 4096 --gemv-links 8,24 --out $OUT
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

from trtbuild.kernels.grid_dependency import release_successor, wait_for_predecessor  # noqa: E402


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
def _grid_barrier(count_ptr, target):
    """Wait until `target` arrivals at count_ptr (zeroed before the launch), this program's included: as a
    grid sync does it, every thread's stores are ordered before one thread's release."""
    tl.debug_barrier()
    tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")
    while tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu") < target:
        pass
    tl.debug_barrier()


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
        _grid_barrier(count_ptr, (i + 1) * programs)


PREFETCH_CHUNK = 4096  # bytes per bulk prefetch instruction
CHUNK_ELEMS = tl.constexpr(PREFETCH_CHUNK // 2)  # bf16 elements per chunk, as the kernels see it


@triton.jit
def _prefetch_l2(first_row, CHUNKS: tl.constexpr, CHUNK_ELEMS: tl.constexpr):
    """L2 prefetches of CHUNKS chunks from `first_row` (a bf16 pointer) on; returns an int32 zero computed
    from them, for what must come after them to take as an input. (A chunk vector smaller than the
    program's threads is replicated: some prefetches are issued more than once, which L2 merges.)"""
    addr = first_row + tl.arange(0, CHUNKS) * CHUNK_ELEMS
    size = tl.full([CHUNKS], CHUNK_ELEMS * 2, tl.int32)
    issued = tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                                       [addr, size], dtype=tl.int32, is_pure=True, pack=1)
    return tl.max(issued, 0)


@triton.jit
def _prefetch_then_wait(first_row, CHUNKS: tl.constexpr, CHUNK_ELEMS: tl.constexpr):
    """L2 prefetches of CHUNKS chunks from `first_row` on, then the PDL wait, which takes the prefetches'
    (zero) result as its input so it cannot be scheduled before them. Returns an int32 zero to add to
    every pointer, as `wait_for_predecessor` does."""
    zero = tl.inline_asm_elementwise("griddepcontrol.wait; mov.u32 $0, $1;", "=r,r",
                                     [_prefetch_l2(first_row, CHUNKS, CHUNK_ELEMS)],
                                     dtype=tl.int32, is_pure=True, pack=1)
    # unannotated, the pointers would lose their 16-byte alignment and the loads their vector width
    return tl.multiple_of(zero, 16)


@triton.jit
def _gemv(w_ptr, x_ptr, count_ptr, programs, first, links, N: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, PDL: tl.constexpr, BARRIER: tl.constexpr, PREFETCH: tl.constexpr = 0):
    """Links first .. first + links - 1 of the chain x[i + 1] = W[i] @ x[i] (x: [L + 1, N] bf16, W: [L, N, N]
    bf16, fp32 sums): `programs` programs (one or a few per SM), each taking every `programs`-th block of
    BLOCK_N rows. With BARRIER, one launch does every link, a grid barrier between them; without, one launch
    per link. With PREFETCH (4 KB chunks, a power of two), the program prefetches the first chunks of its
    first block of rows of a link into L2 while it may not yet read x: under PDL before its wait; with
    BARRIER between its arrival and its wait at the barrier before that link, when its own share of the
    link before is done and the DRAM may idle while the slowest programs finish theirs."""
    pid = tl.program_id(0)
    block = tl.minimum(pid, N // BLOCK_N - 1)  # a program past the last block prefetches the last block's rows
    if PDL:
        if PREFETCH:
            z = _prefetch_then_wait(w_ptr + first * (N * N) + block * (BLOCK_N * N), PREFETCH, CHUNK_ELEMS)
        else:
            z = wait_for_predecessor()
        w_ptr, x_ptr, count_ptr = w_ptr + z, x_ptr + z, count_ptr + z
    k = tl.arange(0, BLOCK_K)
    for i in range(first, first + links):
        w_mat = w_ptr + i * (N * N)  # int32 offsets: run_gemv keeps L * N * N below 2**31
        x_row = x_ptr + i * N
        for nb in range(pid, N // BLOCK_N, programs):
            rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
            acc = tl.zeros([BLOCK_N], tl.float32)
            for k0 in range(0, N, BLOCK_K):
                xv = tl.load(x_row + k0 + k, cache_modifier=".cg").to(tl.float32)  # written by other SMs
                wv = tl.load(w_mat + rows[:, None] * N + (k0 + k)[None, :])
                acc += tl.sum(wv.to(tl.float32) * xv[None, :], 1)
            if PDL:
                acc = release_successor(acc)
            tl.store(x_ptr + (i + 1) * N + rows, acc.to(x_ptr.dtype.element_ty), cache_modifier=".cg")
        if BARRIER:
            # _grid_barrier, with the next link's prefetch between this program's arrival and its wait: the
            # arrival's release would otherwise hold the prefetch's issue back (weights are never written,
            # so reading them early is safe)
            tl.debug_barrier()
            tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")
            target = (i - first + 1) * programs
            if PREFETCH:
                if i + 1 < first + links:  # the prefetches' zero feeds the wait: they are issued before it
                    target += _prefetch_l2(w_ptr + (i + 1) * (N * N) + block * (BLOCK_N * N), PREFETCH, CHUNK_ELEMS)
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


GEMV_CONFIGS = [(32, 256, 4, 3), (32, 512, 8, 3), (16, 512, 4, 4)]  # block_n, block_k, warps, stages
# --gemv-grid blocks: one program per block of rows, as the engine's decode matmul launches, in the narrow
# configurations its selection keeps at batch 1 (RESULTS.md, sixteenth session: n4k1024w4s1, n8k1024w4s3)
BLOCK_GRID_CONFIGS = [(4, 1024, 4, 1), (8, 1024, 4, 3), (16, 512, 4, 3)]


def run_gemv(w: torch.Tensor, x: torch.Tensor, programs: int, config: tuple[int, int, int, int], mode: str,
             count: torch.Tensor | None = None, prefetch_kb: int = 0) -> None:
    """The chain over every matrix of w ([L, N, N]) from x[0] into x[1..L]: `launch` or `launch-pdl`, one
    launch per link; `barrier`, one launch (count: an int32 counter, zeroed here). With `prefetch_kb`
    (launch-pdl or barrier): that many KB of each program's first rows of a link, at most its block's,
    prefetched before its wait for the link before.
    `programs` 0: one program per block of rows (not for `barrier`, which needs every program resident)."""
    links, n = w.shape[0], w.shape[1]
    block_n, block_k, warps, stages = config
    if n % block_n or n % block_k or x.shape != (links + 1, n) or links * n * n >= 2**31:
        raise ValueError(f"chain_probe: {n} rows in blocks of {block_n} x {block_k}, x {tuple(x.shape)}")
    kw = dict(N=n, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    if programs == 0:
        if mode == "barrier":
            raise ValueError("chain_probe: the barrier needs one program per SM, not one per block of rows")
        programs = n // block_n
    chunks = 0
    if prefetch_kb:
        if mode == "launch" or prefetch_kb * 1024 % PREFETCH_CHUNK or (prefetch_kb * 1024 // PREFETCH_CHUNK) & (
                prefetch_kb * 1024 // PREFETCH_CHUNK - 1) or n * 2 % PREFETCH_CHUNK:
            raise ValueError(f"chain_probe: a prefetch of {prefetch_kb} KB needs launch-pdl or barrier, a power of two "
                             f"of 4 KB chunks and rows of whole chunks")
        chunks = min(prefetch_kb * 1024, block_n * n * 2) // PREFETCH_CHUNK
    if mode == "barrier":
        assert count is not None
        count.zero_()
        _gemv[(programs,)](w, x, count, programs, 0, links, PDL=False, BARRIER=True, PREFETCH=chunks, **kw)
        return
    for i in range(links):
        _gemv[(programs,)](w, x, x, programs, i, 1, PDL=mode == "launch-pdl", BARRIER=False, PREFETCH=chunks, **kw)


def reference_gemv(w: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """The chain in fp32, rounded to x0's dtype after each link as the kernels store it: [L + 1, N]."""
    rows = [x0]
    for wi in w:
        rows.append((wi.float() @ rows[-1].float()).to(x0.dtype))
    return torch.stack(rows)


def _replay_seconds(calls: Callable[[], object], programmatic: bool, reps: int) -> tuple[float, int]:
    """Seconds per replay of a graph of `calls` (every kernel-to-kernel edge made programmatic first when
    asked: every kernel of this probe waits), and the number of edges made so."""
    from trtbuild.backends.torch.pdl import Driver, kernel_edges
    from trtbuild.timing import graph_seconds

    made: list[int] = []

    def all_programmatic(graph: int) -> None:
        drv = Driver()
        chosen = kernel_edges(drv.edges(graph), drv.kernel_names(graph))
        drv.make_programmatic(graph, chosen)
        made.append(len(chosen))

    seconds = graph_seconds(calls, reps, all_programmatic if programmatic else None)
    return seconds, sum(made)


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


def measure_gemv(case: str, w: torch.Tensor, programs: int, config: tuple[int, int, int, int] | None,
                 reps: int, prefetch_kb: int = 0) -> dict[str, Any]:
    """One GEMV chain case over every matrix of w: checked against the fp32 chain, then timed in a graph."""
    links, n = w.shape[0], w.shape[1]
    x = torch.zeros(links + 1, n, device="cuda", dtype=w.dtype)
    x[0] = torch.randn(n, device="cuda", generator=torch.Generator("cuda").manual_seed(0)).to(w.dtype)
    count = torch.zeros(1, device="cuda", dtype=torch.int32)

    def calls() -> None:
        if case == "cublas":
            for i in range(links):
                torch.mm(x[i:i + 1], w[i].t(), out=x[i + 1:i + 2])
        else:
            assert config is not None
            run_gemv(w, x, programs, config, case, count, prefetch_kb)

    calls()
    torch.cuda.synchronize()
    want = reference_gemv(w, x[0]).float()
    err = ((x.float() - want).abs().max() / want.abs().max()).item()
    seconds, edges = _replay_seconds(calls, case == "launch-pdl", reps)
    return {"case": case, "links": links, "us": seconds * 1e6, "max_rel_err": err, "correct": err <= 2e-2,
            "programmatic_edges": edges, "prefetch_kb": prefetch_kb}


def gemv_rows(n: int, short: int, long: int, programs: int, reps: int, prefetch_kb: tuple[int, ...] = (),
              barrier_prefetch_kb: tuple[int, ...] = (), narrow: bool = False) -> list[dict[str, Any]]:
    """Per case, the cost per link of the GEMV chain (the slope between `short` and `long` links) and the
    weight bytes per µs of that slope; the probe's kernel in each of its configurations, a row each,
    `launch-pdl` again with each of `prefetch_kb` and `barrier` with each of `barrier_prefetch_kb`.
    `programs` 0: the engine's grid, one program per block of rows, in its configurations (no barrier
    case); `narrow`: the engine's configurations over `programs` programs (several per SM), barrier too."""
    g = torch.Generator("cuda").manual_seed(1)
    w = (torch.randn(long, n, n, device="cuda", generator=g) * n ** -0.5).to(torch.bfloat16)
    rows: list[dict[str, Any]] = []
    configs, modes = (BLOCK_GRID_CONFIGS, ("launch", "launch-pdl")) if programs == 0 else (
        BLOCK_GRID_CONFIGS if narrow else GEMV_CONFIGS, ("launch", "launch-pdl", "barrier"))
    cases = [("cublas", None, 0)] + [(c, cfg, 0) for c in modes for cfg in configs]
    cases += [("launch-pdl", cfg, kb) for kb in prefetch_kb for cfg in configs]
    cases += [("barrier", cfg, kb) for kb in barrier_prefetch_kb for cfg in configs if programs]
    for case, cfg, kb in cases:
        try:
            runs = [measure_gemv(case, w[:links], programs, cfg, reps, kb) for links in (short, long)]
        except Exception as e:  # a configuration that does not compile here is a measurement too
            rows.append({"case": case, "config": cfg, "prefetch_kb": kb, "error": f"{type(e).__name__}: {str(e)[:120]}"})
            continue
        slope = (runs[1]["us"] - runs[0]["us"]) / (long - short)
        rows.append({"case": case, "config": cfg, "prefetch_kb": kb, "us_per_link": slope, "tb_s": n * n * 2 / slope / 1e6,
                     "runs": runs, "correct": all(r["correct"] for r in runs)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--links", default="32,320", help="two chain lengths; the cost per link is the slope between them")
    ap.add_argument("--block", type=int, default=256, help="fp32 elements each program reads and writes a step")
    ap.add_argument("--gemv", type=int, default=4096, help="the GEMV chain's square matrix size (0 skips it)")
    ap.add_argument("--gemv-links", default="8,24", help="two GEMV chain lengths")
    ap.add_argument("--prefetch-kb", default="", help="launch-pdl again with each of these KB prefetched before the "
                    "wait (comma-separated powers of two of 4 KB, e.g. 16,64,256)")
    ap.add_argument("--barrier-prefetch-kb", default="", help="barrier again with each of these KB of the next link "
                    "prefetched between a program's arrival and its wait (as --prefetch-kb; sms grid only)")
    ap.add_argument("--per-sm", type=int, default=1, help="programs per SM of the sms grid; above 1 the engine's "
                    "batch-1 configurations (narrow blocks of rows), so the barrier runs the engine's kind of grid")
    ap.add_argument("--gemv-grid", choices=("sms", "blocks"), default="sms",
                    help="the GEMV chain's programs: one per SM, each looping over blocks of rows (the default), or "
                    "one per block of rows, as the engine's decode matmul launches (no barrier case)")
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
    gemv: list[dict[str, Any]] = []
    if args.gemv:
        g_short, g_long = sorted(int(n) for n in args.gemv_links.split(","))
        kbs = tuple(int(kb) for kb in args.prefetch_kb.split(",") if kb)
        barrier_kbs = tuple(int(kb) for kb in args.barrier_prefetch_kb.split(",") if kb)
        sms = args.gemv_grid == "sms"
        gemv = gemv_rows(args.gemv, g_short, g_long, programs * args.per_sm if sms else 0, args.reps, kbs, barrier_kbs,
                         narrow=args.per_sm > 1)
        mb = args.gemv ** 2 * 2 / 1e6
        print(f"\nGEMV chain, {args.gemv}x{args.gemv} bf16 ({mb:.1f} MB a link), links {g_short} and {g_long}, "
              f"{f'{args.per_sm} program(s) per SM' if sms else 'one program per block of rows'}")
        print(f"{'case':12} {'config':18} {'us/link':>8} {'TB/s':>6}  result")
        for r in gemv:
            cfg = "-" if r["config"] is None else "n{}k{}w{}s{}".format(*r["config"])
            cfg += f" +{r['prefetch_kb']}KB" if r["prefetch_kb"] else ""
            if "error" in r:
                print(f"{r['case']:12} {cfg:18} {r['error']}")
            else:
                err = max(x["max_rel_err"] for x in r["runs"])
                print(f"{r['case']:12} {cfg:18} {r['us_per_link']:8.2f} {r['tb_s']:6.2f}  "
                      f"{'correct' if r['correct'] else 'WRONG'} (max rel err {err:.1e})")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "programs": programs,
              "gemv_grid": args.gemv_grid, "per_sm": args.per_sm,
              "block": args.block, "rows": rows, "gemv": gemv, "seconds": time.perf_counter() - t0}
    (Path(args.out) / "chain-probe.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
