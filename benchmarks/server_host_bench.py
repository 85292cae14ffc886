"""How much of a paged server's step time is the host's: the real HTTP server and scheduler over an engine whose
device work is a sleep of a GPU's measured length, under N streaming clients.

    python benchmarks/server_host_bench.py --out /tmp/host                       # 16, 64, 256 clients
    python benchmarks/server_host_bench.py --clients 256 --switch-ms 5,0.5 --out /tmp/host
    python benchmarks/server_host_bench.py --rows 8 --clients 16 --per-client 40 --out /tmp/host-rows  # row cache

Under load a server's GPU waits whenever the host is busy between two steps: the scheduler's bookkeeping, and
the HTTP side's work for every token (one server-sent event a token a stream), which runs in the same process
and shares the GIL with the engine thread. Here the engine (`SleepEngine`) does the host work of the real
paged path (the bucket buffer filled as PagedDecodeGraphs fills it) and then sleeps, the GIL released as a
CUDA synchronization releases it, for the time an H100 took for that call (`--decode-ms` + `--row-us` a row
for a decode step; `--chunk-ms` per 512 prompt tokens, a call's chunks padded to the longest as the real call
pads them). `--rows N` serves the row cache of N rows instead (the
gate's serve row: 8 rows, 16 streams), one prompt a prefill call at the chunk rate. `trtbuild serve`'s code runs unchanged around it
(serving/server.py's `serve`, uvicorn, FastAPI, the scheduler, the prefix cache's block pool).

The engine keeps the device's order: a call starts when the calls before it have ended. `launch_paged` (the
overlapped steps serve uses by default) returns at once and its result waits for the step's end, so the host's
work between steps runs while the "device" runs; `--modes overlap,in-turn` compares that with every step read
back before the next (serve --no-overlap). A step with prompt chunks is one call (the mixed step), costed as
its decode step plus its chunks: what the mixed step saves on a GPU is not the host's.

Per (clients, switch interval, mode): output tokens per second as the clients count them; the engine's busy
fraction (its sleeps' sum over the wall time: 1.0 means the host never held the device back); and the host
gap, the wall time a step beyond its sleeps, split into the time between two engine calls and the time an
engine call overran its sleep (waiting for the GIL). The switch interval is Python's
`sys.setswitchinterval`, how long a thread holding the GIL runs before a waiting one may take it; `serve`
sets it (serving/server.py), this bench overrides it to compare. The clients run in this process, the server
in a child: on a machine of few cores they compete for them (state the core count with the figures).
Prints a table; writes server_host_bench.json and, where matplotlib imports, server_host_bench.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

BLOCK, MAX_SEQ, MAX_INPUT, ROWS = 16, 4096, 2048, 256


# -- the server side (a child process) --------------------------------------------------------------------------
class _Paged:
    block_size = BLOCK


class SleepEngine:
    """The paged slot API with the host work of the real path and a sleep in place of the device's."""

    max_batch_size, max_input_len, max_seq_len, vocab_size = 1, MAX_INPUT, MAX_SEQ, 1000
    can_page = can_mix = can_overlap = True
    spec: dict[str, Any] = {}

    def __init__(self, decode_ms: float, row_us: float, chunk_ms: float, releases: int, rows: int = 0) -> None:
        from trtbuild.backends.torch.paged_graphs import PagedDecodeGraphs

        self.releases = max(1, releases)
        if rows:  # the row cache: `rows` cache rows, decode buckets 1 and rows
            self.can_page, self.max_batch_size, self.buckets = False, rows, sorted({1, rows})
            self.can_mix = self.can_overlap = False
        self.decode_s, self.row_s, self.chunk_s = decode_ms / 1e3, row_us / 1e6, chunk_ms / 1e3
        self.graphs = PagedDecodeGraphs(None, [], "cpu", width=MAX_SEQ // BLOCK, scratch=1 << 20, max_rows=ROWS)
        self.paged: Any = None
        self.busy_until = 0.0  # when the device finishes what it was given
        self.stats: dict[str, Any] = {"events": [], "steps": []}

    def open_pool(self, memory: float, blocks: int | None, captured_chunks: bool = False,
                  captured_mixed: bool = True) -> int:
        self.paged = _Paged()
        n = blocks or ROWS * MAX_SEQ // BLOCK
        self.kv_capacity_tokens, self.kv_layout = n * BLOCK, f"paged: {n} blocks of {BLOCK} tokens (a sleep)"
        return n

    def _device(self, seconds: float, warm: bool) -> None:
        t = time.perf_counter()
        # the real call's torch ops before its synchronization (a copy, a replay, a slice), each releasing the GIL
        # and taking it back, as torch's Python bindings do around every op
        for _ in range(self.releases - 1):
            time.sleep(0)
        # the device runs calls in order: a call made while a launched step runs starts when that step ends
        start = max(t, self.busy_until)
        time.sleep(max(0.0, start - time.perf_counter()) + seconds)  # releases the GIL, as a CUDA sync does
        now = time.perf_counter()
        self.busy_until = now
        if warm:  # the server's warm-up calls (request id -1), before any client
            return
        # (start, end, slept): the clients' side keeps the calls made while they ran (the row cache's warm-up
        # calls look like any other). perf_counter is the system's monotonic clock: the two processes read the
        # same one.
        self.stats["events"].append((start, now, seconds))

    def _launch(self, seconds: float, warm: bool) -> float:
        """A call the host does not wait for: it starts when the device is free, and this returns when it ends."""
        for _ in range(self.releases - 1):
            time.sleep(0)
        start = max(time.perf_counter(), self.busy_until)
        self.busy_until = start + seconds
        if not warm:
            self.stats["events"].append((start, self.busy_until, seconds))
            self.stats["steps"].append(self.busy_until)
        return self.busy_until

    def _decode_s(self, keys: list[int], blocks: list[list[int]], tokens: list[int], positions: list[int]) -> float:
        from trtbuild.backends.torch.paged_graphs import bucket_for

        rows = [b[:(p + BLOCK) // BLOCK] for b, p in zip(blocks, positions)]
        self.graphs.host_rows(bucket_for(len(keys), self.graphs.sizes), rows, tokens, positions)
        return self.decode_s + self.row_s * len(keys)

    def step_paged(self, decode: tuple[Any, ...], chunks: tuple[Any, ...]) -> tuple[list[int], list[int | None]]:
        """The mixed step, costed as its two calls (whatever it saves on a GPU is not the host's)."""
        keys = decode[0]
        self._device(self._decode_s(*decode[:4]) + self._chunks_s(chunks[2]), keys[0] < 0)
        if keys[0] >= 0:
            self.stats["steps"].append(time.perf_counter())
        return [2] * len(keys), [1 if last else None for last in chunks[5]]

    def launch_paged(self, decode: tuple[Any, ...], chunks: tuple[Any, ...] | None, fed: list[tuple[int, int]]) -> Any:
        keys = decode[0]
        seconds = self._decode_s(*decode[:4]) + (self._chunks_s(chunks[2]) if chunks else 0.0)
        end = self._launch(seconds, keys[0] < 0)
        lasts = chunks[5] if chunks else []

        class Launched:
            device_seconds = None  # the real step's device time (CUDA events); the busy fraction is this bench's own

            def result(self) -> tuple[list[int], list[int | None]]:
                time.sleep(max(0.0, end - time.perf_counter()))
                return [2] * len(keys), [1 if last else None for last in lasts]
        return Launched()

    def prefill_paged(self, keys: list[int], blocks: list[list[int]], tokens: list[list[int]], starts: list[int],
                      sampling: list[Any], lasts: list[bool]) -> list[int | None]:
        self._device(self._chunks_s(tokens), keys[0] < 0)
        return [1 if last else None for last in lasts]

    def _chunks_s(self, chunks: list[list[int]]) -> float:
        """A call's chunks, as the rows of one call left-padded to the longest: padding computed too."""
        return self.chunk_s * len(chunks) * max(map(len, chunks)) / 512

    def decode_paged(self, keys: list[int], blocks: list[list[int]], tokens: list[int], positions: list[int],
                     sampling: list[Any]) -> list[int]:
        self._device(self._decode_s(keys, blocks, tokens, positions), keys[0] < 0)
        if keys[0] >= 0:
            self.stats["steps"].append(time.perf_counter())
        return [2] * len(keys)

    def release(self, key: int) -> None:
        pass

    # the row cache's slot API (`--rows`): one prompt a prefill call, a decode step of the bucket's rows
    def prefill(self, slot: int, tokens: list[int], sampling: Any = None) -> int:
        self._device(self.chunk_s * len(tokens) / 512, False)
        return 1

    def decode(self, slots: list[int], tokens: list[int], positions: list[int], sampling: list[Any]) -> list[int]:
        bucket = next(b for b in self.buckets if b >= len(slots))
        self._device(self.decode_s + self.row_s * bucket, False)
        self.stats["steps"].append(time.perf_counter())
        return [2] * len(slots)


class _Session:
    """What serving/server.py reads of a runner.Session."""

    def __init__(self, engine: SleepEngine) -> None:
        from types import SimpleNamespace

        self.engine = engine
        self.recipe = SimpleNamespace(name="sleep", precision="bf16", backend="torch")
        self.outcome = SimpleNamespace(cache_hit=True, key="sleep", entry=SimpleNamespace(path="-"), fleet={},
                                       model=SimpleNamespace(folder=None))

    def __enter__(self) -> _Session:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def serve_child(args: argparse.Namespace) -> None:
    from trtbuild.serving.server import KvSettings, serve

    engine = SleepEngine(args.decode_ms, args.row_us, args.chunk_ms, args.releases, args.rows)
    cache = "rows" if args.rows else "paged"
    try:
        serve(_Session(engine), port=args.serve, max_queue=4096, log_level="warning",
              kv=KvSettings(cache, 0.9, None, args.prefill_chunk, True, True, args.modes == "overlap",
                            prefill_order=args.prefill_order),
              switch_interval=float(args.switch_ms) / 1e3)
    finally:
        Path(args.stats).write_text(json.dumps(engine.stats))


# -- the clients (this process) ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def level(clients: int, switch_ms: float, mode: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from serve_bench import Clients, get, percentile, scrape, workload

    port, stats = free_port(), tmp / f"stats-{clients}-{switch_ms}-{mode}.json"
    cmd = [sys.executable, __file__, "--serve", str(port), "--stats", str(stats), "--switch-ms", str(switch_ms),
           "--modes", mode,
           "--decode-ms", str(args.decode_ms), "--row-us", str(args.row_us), "--chunk-ms", str(args.chunk_ms),
           "--releases", str(args.releases), "--prefill-chunk", str(args.prefill_chunk), "--rows", str(args.rows),
           "--prefill-order", args.prefill_order]
    proc = subprocess.Popen(cmd, cwd=REPO)
    try:
        for _ in range(600):
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited ({proc.returncode})")
            try:
                if get(port, "/health", 2.0)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.1)
        else:
            raise RuntimeError("the server did not come up")
        reqs = workload(clients * args.per_client, MAX_INPUT, MAX_SEQ, False, 1000, kind=args.workload)
        cl = Clients(port, "sleep", reqs)
        begun = time.perf_counter()
        wall = cl.run(clients)
        metrics = scrape(port)
    finally:
        proc.terminate()
        proc.wait(60)
    s = json.loads(stats.read_text())
    events = [e for e in s["events"] if e[0] >= begun]
    steps = sum(1 for t in s["steps"] if t >= begun)
    ok = [r for r in cl.results if "error" not in r]
    tokens = sum(r["tokens"] for r in ok)
    span = events[-1][1] - events[0][0]
    slept = sum(e[2] for e in events)
    overran = sum(max(0.0, e[1] - e[0] - e[2]) for e in events)
    gap = span - slept  # the engine's active span less its sleeps: host time the device waited for
    return {"clients": clients, "switch_ms": switch_ms, "mode": mode, "requests": len(ok), "errors": len(cl.results) - len(ok),
            "tok_s": tokens / wall, "busy": slept / span, "steps": steps, "calls": len(events),
            "gap_ms_per_step": gap / max(1, steps) * 1e3,
            "overrun_ms_per_step": overran / max(1, steps) * 1e3,
            "ttft_p50_ms": percentile([r["ttft_s"] for r in ok], 50) * 1e3,
            "ttft_p99_ms": percentile([r["ttft_s"] for r in ok], 99) * 1e3,
            # the mean TTFT as the clients saw it and as the scheduler counted it (arrival in the queue to the
            # first token's delivery): the difference is the HTTP side's, before the queue and after the token
            "ttft_mean_ms": sum(r["ttft_s"] for r in ok) / max(1, len(ok)) * 1e3,
            "ttft_server_mean_ms": metrics.get("trtbuild_time_to_first_token_seconds_sum", 0.0)
            / max(1.0, metrics.get("trtbuild_time_to_first_token_seconds_count", 0.0)) * 1e3,
            "tpot_p50_ms": percentile([r["tpot_s"] for r in ok if r["tpot_s"]], 50) * 1e3}


def table_text(rows: list[dict[str, Any]]) -> str:
    head = (f"{'clients':>7} {'switch ms':>9} {'steps are':>9} {'tok/s':>8} {'busy':>6} {'steps':>6} {'host gap ms/step':>16} "
            f"{'of it GIL ms':>12} {'TTFT p50':>9} {'TTFT p99':>9} {'TTFT mean':>9} {'in server':>9} {'TPOT p50':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['clients']:>7} {r['switch_ms']:>9g} {r.get('mode', 'in-turn'):>9} {r['tok_s']:>8.0f} {r['busy']:>6.2f} {r['steps']:>6} "
                     f"{r['gap_ms_per_step']:>16.3f} {r['overrun_ms_per_step']:>12.3f} {r['ttft_p50_ms']:>9.1f} "
                     f"{r['ttft_p99_ms']:>9.1f} {r['ttft_mean_ms']:>9.1f} {r['ttft_server_mean_ms']:>9.1f} {r['tpot_p50_ms']:>9.2f}")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for sw, mode in sorted({(r["switch_ms"], r.get("mode", "in-turn")) for r in rows}):
        pts = [r for r in rows if r["switch_ms"] == sw and r.get("mode", "in-turn") == mode]
        ax.plot([r["clients"] for r in pts], [r["busy"] for r in pts], marker="o", label=f"{mode}, switch {sw:g} ms")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("streaming clients")
    ax.set_ylabel("engine busy fraction")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", default="16,64,256")
    ap.add_argument("--switch-ms", default="0.2", help="Python switch intervals to compare (ms); serve sets 0.2")
    ap.add_argument("--modes", default="overlap,in-turn",
                    help="paged steps launched before the step before is read back (overlap; serve's default) or "
                         "each read back first (in-turn: serve --no-overlap)")
    ap.add_argument("--per-client", type=int, default=2, help="requests each client sends")
    ap.add_argument("--decode-ms", type=float, default=1.1, help="a decode step's fixed device time")
    ap.add_argument("--row-us", type=float, default=30.0, help="a decode step's device time a row")
    ap.add_argument("--chunk-ms", type=float, default=2.5, help="device time per 512 prompt tokens")
    ap.add_argument("--releases", type=int, default=4,
                    help="times an engine call releases the GIL (its torch ops), the last for the device time")
    ap.add_argument("--prefill-chunk", type=int, default=512, help="serve's --prefill-chunk")
    ap.add_argument("--prefill-order", default="shortest", choices=["arrival", "shortest"],
                    help="serve's --prefill-order")
    ap.add_argument("--workload", default="random", choices=["random", "shared-prefix"],
                    help="serve_bench's workloads: random prompts of 256-1024 tokens, or a shared 1,000-token prefix")
    ap.add_argument("--rows", type=int, default=0,
                    help="serve the row cache with this many rows (the gate's serve row: 8) instead of the paged one")
    ap.add_argument("--out", default="server-host-bench-out")
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--stats", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve is not None:
        serve_child(args)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=REPO).stdout.strip() or "?"
    report: dict[str, Any] = {"commit": commit, "command": " ".join(sys.argv), "cores": os.cpu_count(),
                              "cpu": platform.processor() or platform.machine(),
                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                              "engine": {"decode_ms": args.decode_ms, "row_us": args.row_us,
                                         "chunk_ms_per_512": args.chunk_ms, "releases": args.releases},
                              "prefill_chunk": args.prefill_chunk, "prefill_order": args.prefill_order,
                              "workload": args.workload,
                              "cache_rows": args.rows, "rows": []}
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(x) for x in args.clients.split(",")]:
            for sw, mode in [(float(x), m) for x in args.switch_ms.split(",") for m in args.modes.split(",")]:
                r = level(n, sw, mode, args, Path(tmp))
                report["rows"].append(r)
                print(f"[server_host_bench] {n} clients, switch {sw:g} ms, {mode}: {r['tok_s']:.0f} tok/s, busy "
                      f"{r['busy']:.2f}, gap {r['gap_ms_per_step']:.2f} ms a step", flush=True)
                (out / "server_host_bench.json").write_text(json.dumps(report, indent=1) + "\n")
    print(table_text(report["rows"]))
    try:
        plot(report["rows"], out / "server_host_bench.png")
    except ImportError:
        print("[server_host_bench] matplotlib is not importable here: no plot (the JSON has every number)")


if __name__ == "__main__":
    threading.stack_size(256 * 1024)  # hundreds of client threads
    main()
