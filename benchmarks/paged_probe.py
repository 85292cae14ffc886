"""Where the paged graph's time goes on a device: prompt chunks and decode steps, each timed alone.

    python benchmarks/paged_probe.py recipes/llama-3.2-1b.yaml --engines /tmp/e --out $OUT
    python benchmarks/paged_probe.py recipes/tiny-llama.yaml --chunks 8,32 --contexts 0,16 --rows 1,4 --decode-context 40 \
        --together 2x8 --mixed 4x16 --out /tmp/p

`trtbuild serve --kv-cache paged` runs two kinds of call: a prompt chunk (one request's next tokens, written
through its block table) and a decode step of every running row (replayed from the row-count bucket's CUDA
graph). Under load a server's throughput is set by how long each takes; this times them outside a server.
The recipe is built (or found) with `options.kv_cache: paged`, as `serve_bench.py --paged` builds it, and its
pool opened with --blocks blocks. Medians of --iters calls, the device synchronized around each:

- a chunk of C tokens (--chunks) after S tokens already in the request's blocks (--contexts): its wall time,
  and on CUDA, under torch.profiler, its kernels' summed time split into attention, matmul and other kernels,
  so a chunk shows whether its launches or which kernels bound it;
- the same C tokens through the engine's prefill graph (the row cache), the time a chunk could approach;
- --together R x T: R requests' chunks of T tokens after the largest context, shared as a prefix cache shares
  it, in one call (as the server batches a step's chunks) and in one call each;
- a decode step of R rows (--rows) at --decode-context tokens each, against its floor (bench.py's: the weights and
  the rows' KV read once at the measured copy rate).
- --mixed R x C: a decode step of R rows and a chunk of C tokens after the largest context, in one call of the
  mixed step (the server's default where both are in a step), replayed from the mixed step's captured graph
  where a bucket takes it (serve's launched steps, CUDA), and as the two calls (`serve --no-mixed-step`).

Prints a table; writes paged_probe.json and, where matplotlib imports, paged_probe.png under --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # trtbuild, run from a checkout
sys.path.insert(0, str(HERE))
import trtbuild  # noqa: E402,F401  - before torch: one libstdc++ for the compiled graphs

from bench import decode_bytes  # noqa: E402
from serve_bench import serving_recipe  # noqa: E402
from trtbuild.measure.ceilings import cached  # noqa: E402
from trtbuild.recipe import load_recipe  # noqa: E402
from trtbuild.runner import open_session  # noqa: E402
from trtbuild.store.local import Store  # noqa: E402


def timed(fn: Callable[[], Any], device: str, iters: int) -> float:
    """The median seconds of `fn`, the device synchronized before and after each call (two untimed first)."""
    import torch

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


@contextmanager
def host_load() -> Iterator[None]:
    """A thread that keeps the GIL busy as a loaded server's event loop does (encoding small JSON chunks, never
    sleeping), at the switch interval `serve` sets: a call timed inside it shows what the host's share of the call
    (its launches) costs when the host is busy, as it is under many streams."""
    import threading

    try:
        from trtbuild.serving.server import SWITCH_INTERVAL_S
    except ImportError:  # no FastAPI here: the interpreter's own interval
        SWITCH_INTERVAL_S = sys.getswitchinterval()
    stop = threading.Event()
    chunk = {"id": "cmpl-0", "object": "text_completion", "choices": [{"index": 0, "text": " the", "logprobs": None}]}

    def busy() -> None:
        while not stop.is_set():
            json.dumps(chunk)

    before = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    thread = threading.Thread(target=busy, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(before)


def kernel_split(fn: Callable[[], Any], device: str) -> dict[str, float] | None:
    """One call of `fn` under torch.profiler: its CUDA kernels' summed milliseconds by kind, and the count."""
    if not device.startswith("cuda"):
        return None
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out: dict[str, Any] = {"attention_ms": 0.0, "matmul_ms": 0.0, "other_ms": 0.0, "kernels": 0}
    by_name: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = ev.name.lower()
        # trtbuild's paged kernels are _paged_partial, _paged_merge and _paged_chunk
        kind = ("attention_ms" if any(k in name for k in ("attention", "attn", "flash", "_paged_")) else
                "matmul_ms" if any(k in name for k in ("gemm", "matmul", "nvjet", "cutlass", "sm90_xmma")) else
                "other_ms")
        out[kind] += ev.device_time_total / 1e3
        out["kernels"] += 1
        by_name[ev.name[:60]] = by_name.get(ev.name[:60], 0.0) + ev.device_time_total / 1e3
    out["kernel_ms"] = out["attention_ms"] + out["matmul_ms"] + out["other_ms"]
    out["top"] = dict(sorted(by_name.items(), key=lambda kv: -kv[1])[:8])  # the costliest kernels, ms summed
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("recipe", type=Path)
    ap.add_argument("--engines", default=None)
    ap.add_argument("--out", default="paged-probe-out")
    ap.add_argument("--chunks", default="128,512,2048", help="prompt chunk lengths")
    ap.add_argument("--contexts", default="0,1024", help="tokens already in the request's blocks before a chunk")
    ap.add_argument("--rows", default="1,16,64,256", help="decode step rows")
    ap.add_argument("--decode-context", type=int, default=512, help="tokens each decode row has")
    ap.add_argument("--together", default="8x64",
                    help="ROWSxTOKENS: that many requests' chunks after the largest context, shared (a prefix "
                         "cache's hit), in one call and in one call each")
    ap.add_argument("--mixed", default="64x512",
                    help="ROWSxTOKENS: a decode step of that many rows and a chunk of that many tokens, in one "
                         "call of the mixed step and as two calls")
    ap.add_argument("--blocks", type=int, default=None, help="pool blocks (default: what the rows and chunks need)")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    chunks = [int(x) for x in args.chunks.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    rows = [int(x) for x in args.rows.split(",")]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE.parent).stdout.strip() or "?"
    report: dict[str, Any] = {"recipe": str(args.recipe), "commit": commit, "command": " ".join(sys.argv),
                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "chunks": [],
                              "prefill_graph": [], "decode": []}

    def save() -> None:
        (out / "paged_probe.json").write_text(json.dumps(report, indent=1) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        path, _ = serving_recipe(args.recipe, None, Path(tmp), paged=True)
        recipe = load_recipe(path)
        with open_session(recipe, args.engines, progress=lambda m: print(f"[paged_probe] {m}", flush=True)) as s:
            engine = s.engine
            device = engine.device
            report["device"] = device
            ceilings = cached(device, Store(args.engines).root / "ceilings")
            report["ceilings"] = ceilings
            vocab = engine.vocab_size
            # the prefill graph (row cache, slot 0) first: the pool below takes the memory left
            for c in chunks:
                if c > engine.max_input_len:
                    continue
                prompt = [(7 * i) % vocab for i in range(c)]
                ms = timed(lambda: engine.prefill(0, prompt), device, args.iters) * 1e3
                report["prefill_graph"].append({"tokens": c, "ms": ms})
                engine.release(0)
            block = 16
            need_chunk = -(-(max(contexts) + max(chunks)) // block)
            need_rows = max(rows) * -(-(args.decode_context + 1) // block)
            n_together, t_together = (int(x) for x in args.together.split("x"))
            need_together = need_chunk + n_together * -(-t_together // block)
            mix_rows, mix_tokens = (int(x) for x in args.mixed.split("x"))
            need_mixed = mix_rows * -(-(args.decode_context + 1) // block) + need_chunk
            blocks = args.blocks or max(need_together, need_rows, need_mixed) + 1
            engine.open_pool(blocks=blocks)
            paged = engine.paged
            assert paged.block_size == block, paged.block_size
            table = list(range(need_chunk))
            for start in contexts:
                if start:  # the context's KV, written once by a chunk of its own
                    paged.prefill(table, [(3 * i) % vocab for i in range(start)], 0)
                for c in chunks:
                    if c > engine.max_input_len or start + c >= engine.max_seq_len:
                        continue
                    tokens = [(5 * i) % vocab for i in range(c)]

                    def call(tokens: list[int] = tokens, start: int = start) -> Any:
                        return paged.prefill(table, tokens, start)

                    ms = timed(call, device, args.iters) * 1e3
                    row: dict[str, Any] = {"tokens": c, "context": start, "ms": ms, "split": kernel_split(call, device)}
                    report["chunks"].append(row)
                    save()
                    print(f"[paged_probe] chunk {c} after {start}: {ms:.3f} ms {row['split'] or ''}", flush=True)
            # several requests' chunks after one shared context (its blocks written by the last chunk loop's
            # context): the prefix cache's case, one call for all against one call each
            start = max(contexts)
            own = -(-t_together // block)
            shared = table[:start // block]
            if start % block == 0 and start + t_together < engine.max_seq_len:
                tabs = [shared + list(range(need_chunk + i * own, need_chunk + (i + 1) * own)) for i in range(n_together)]
                toks = [[(11 * i + j) % vocab for j in range(t_together)] for i in range(n_together)]
                together = timed(lambda: paged.prefill_many(tabs, toks, [start] * n_together), device,
                                 args.iters) * 1e3
                apart = timed(lambda: [paged.prefill(tb, tk, start) for tb, tk in zip(tabs, toks)], device,
                              args.iters) * 1e3
                report["together"] = {"rows": n_together, "tokens": t_together, "context": start,
                                      "one_call_ms": together, "one_call_each_ms": apart}
                save()
                print(f"[paged_probe] {n_together} chunks of {t_together} after {start}: {together:.3f} ms in one "
                      f"call, {apart:.3f} ms in one call each", flush=True)
            per_row = -(-(args.decode_context + 1) // block)
            elem = paged.pools[0].element_size()
            for r in rows:
                if paged.graphs is not None and r > paged.graphs.sizes[-1]:
                    continue
                tables = [list(range(i * per_row, (i + 1) * per_row)) for i in range(r)]
                toks, pos = [1] * r, [args.decode_context] * r
                ms = timed(lambda: paged.decode(tables, toks, pos), device, args.iters) * 1e3
                floor = decode_bytes(engine.cfg, elem, r, args.decode_context + 1) / ceilings["copy_Bps"] * 1e3
                report["decode"].append({"rows": r, "context": args.decode_context, "ms": ms, "floor_ms": floor,
                                         "x_floor": ms / floor, "captured": paged.graphs is not None,
                                         "split": kernel_split(lambda: paged.decode(tables, toks, pos), device)})
                save()
                print(f"[paged_probe] decode {r} rows: {ms:.3f} ms ({ms / floor:.2f}x its floor)", flush=True)
            if paged.mixed_package is not None and mix_tokens <= engine.max_input_len and \
                    start + mix_tokens < engine.max_seq_len:
                report["mixed"] = mixed_row(paged, device, args.iters, mix_rows, mix_tokens, start,
                                            args.decode_context, vocab)
                save()
                m = report["mixed"]
                print(f"[paged_probe] {mixed_text(m)}", flush=True)
    save()
    print(table_text(report))
    try:
        plot(report, out / "paged_probe.png")
    except ImportError:
        print("[paged_probe] matplotlib is not importable here: no plot (the JSON has every number)")


def mixed_row(paged: Any, device: str, iters: int, rows: int, tokens: int, start: int, context: int,
              vocab: int) -> dict[str, Any]:
    """A decode step of `rows` rows at `context` tokens and a chunk of `tokens` after `start`, through the mixed
    step and as the chunk call then the decode call (what a step runs without it; on CUDA both captured where a
    chunk bucket holds the chunk, as `serve --captured-chunks` runs a step), each timed alone and again with a
    thread keeping the host busy (`host_load`)."""
    block = paged.block_size
    per_row = -(-(context + 1) // block)
    tables = [list(range(i * per_row, (i + 1) * per_row)) for i in range(rows)]
    chunk_table = list(range(rows * per_row, rows * per_row + -(-(start + tokens) // block)))
    toks, pos = [1] * rows, [context] * rows
    chunk = [(13 * i) % vocab for i in range(tokens)]

    def one() -> Any:
        return paged.mixed(tables, toks, pos, [chunk_table], [chunk], [start])

    def two() -> Any:
        paged.prefill(chunk_table, chunk, start)
        return paged.decode(tables, toks, pos)

    graphs = getattr(paged, "mixed_graphs", None)

    def captured() -> Any:
        return graphs.run(tables, toks, pos, [chunk_table], [chunk], [start])

    fits = graphs is not None and graphs.bucket(rows, 1, tokens) is not None
    out = {"rows": rows, "tokens": tokens, "context": start, "decode_context": context,
           "one_call_ms": timed(one, device, iters) * 1e3, "two_calls_ms": timed(two, device, iters) * 1e3,
           "captured_ms": timed(captured, device, iters) * 1e3 if fits else None,
           "split": kernel_split(one, device)}
    with host_load():
        out |= {"one_call_loaded_ms": timed(one, device, iters) * 1e3,
                "two_calls_loaded_ms": timed(two, device, iters) * 1e3,
                "captured_loaded_ms": timed(captured, device, iters) * 1e3 if fits else None}
    return out


def mixed_text(m: dict[str, Any]) -> str:
    captured = (f", {m['captured_ms']:.3f} ms replayed from its captured graph" if m.get("captured_ms") else
                ", no captured graph takes it")
    loaded = f" and {m['captured_loaded_ms']:.3f}" if m.get("captured_loaded_ms") else ""
    return (f"{m['rows']} decode rows and a {m['tokens']}-token chunk after {m['context']}: {m['one_call_ms']:.3f} ms "
            f"in one call (mixed){captured}, {m['two_calls_ms']:.3f} ms in two; with the host busy "
            f"{m['one_call_loaded_ms']:.3f}{loaded} and {m['two_calls_loaded_ms']:.3f} ms")


def table_text(report: dict[str, Any]) -> str:
    graph = {p["tokens"]: p["ms"] for p in report["prefill_graph"]}
    lines = [f"paged_probe: {report['recipe']} on {report.get('device')}, {report['date']}, commit {report['commit']}",
             f"{'chunk':>6} {'after':>6} {'ms':>8} {'prefill graph ms':>17} {'kernels ms':>11} {'attention':>10} "
             f"{'matmul':>8} {'other':>8} {'launches':>9}"]
    for c in report["chunks"]:
        sp = c["split"] or {}
        lines.append(f"{c['tokens']:>6} {c['context']:>6} {c['ms']:8.3f} {graph.get(c['tokens'], float('nan')):17.3f} "
                     f"{sp.get('kernel_ms', float('nan')):11.3f} {sp.get('attention_ms', float('nan')):10.3f} "
                     f"{sp.get('matmul_ms', float('nan')):8.3f} {sp.get('other_ms', float('nan')):8.3f} "
                     f"{sp.get('kernels', 0):>9}")
    if (t := report.get("together")):
        lines.append(f"{t['rows']} chunks of {t['tokens']} after {t['context']}: {t['one_call_ms']:.3f} ms in one call, "
                     f"{t['one_call_each_ms']:.3f} ms in one call each")
    if (m := report.get("mixed")):
        lines.append(mixed_text(m))
    lines.append(f"{'rows':>6} {'context':>8} {'ms':>8} {'floor ms':>9} {'x floor':>8}")
    for d in report["decode"]:
        lines.append(f"{d['rows']:>6} {d['context']:>8} {d['ms']:8.3f} {d['floor_ms']:9.3f} {d['x_floor']:8.2f}")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for start in sorted({c["context"] for c in report["chunks"]}):
        cs = [c for c in report["chunks"] if c["context"] == start]
        a.plot([c["tokens"] for c in cs], [c["ms"] for c in cs], "o-", label=f"paged chunk after {start}")
    g = report["prefill_graph"]
    a.plot([p["tokens"] for p in g], [p["ms"] for p in g], "s--", label="prefill graph")
    a.set(xscale="log", xlabel="prompt tokens", ylabel="ms", title="prompt chunks")
    d = report["decode"]
    b.plot([x["rows"] for x in d], [x["ms"] for x in d], "o-", label="paged decode step")
    b.plot([x["rows"] for x in d], [x["floor_ms"] for x in d], "k:", label="floor")
    b.set(xscale="log", xlabel="rows", ylabel="ms", title="decode steps")
    for ax in (a, b):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"paged graph, {report.get('device')}, {report['commit']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
