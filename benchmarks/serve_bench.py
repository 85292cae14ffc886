"""`trtbuild serve` under N concurrent streaming clients: throughput, TTFT, TPOT, occupancy, step vs floor.

    python benchmarks/serve_bench.py recipes/llama-3.2-1b.yaml --rows 64 --out $OUT
    python benchmarks/serve_bench.py recipes/tiny-llama.yaml --quick --engines /tmp/e --out /tmp/o  # CPU smoke test

Per recipe: the recipe with `--rows` cache rows (its decode buckets 1, 8, 16, ... up to the rows) is built
(or found) by `trtbuild build` in a child process, the device's copy bandwidth is measured in another
(trtbuild/measure/ceilings.py), then `trtbuild serve --no-build` starts on a loopback port. For each concurrency N
(1, 8, 32, 64) N client threads send streaming completions back to back (closed loop) from one seeded
list of (prompt length, output length) pairs, greedy, with `ignore_eos` so every request makes exactly its
output length. Clients use the standard library only (http.client), so nothing but the server's own
dependencies is needed on the device.

Figures per N: output tokens per second (all completion tokens / wall time), TTFT and TPOT p50/p99 as the
clients see them, batch occupancy and the decode step against its floor per bucket from the server's
/metrics (the floor: the weights plus the filled KV cache read once a step at the measured copy bandwidth),
and the TTFT bound of the serving target: 2x a lone request's TTFT plus one lone prefill per request that
was waiting for its first token when this one was sent. Writes serve_bench.json (and serve_bench.png
where matplotlib imports) under --out and prints a table last.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
LEVELS = (1, 16, 64, 256)
SYSTEM_PROMPT, QUESTION, OUT = 1000, 64, 128  # the shared-prefix workload: one system prompt, a question each


def server_missing() -> str | None:
    """Why `trtbuild serve` could not start here, checked before anything is built: a lent GPU machine's Python
    lacks FastAPI and uvicorn until their wheels are installed (docs/gate.md), and a run that builds first finds
    out minutes later. The check runs in a child as the server will (this interpreter and environment, from the
    repository)."""
    proc = subprocess.run([sys.executable, "-c", "from trtbuild.serving.server import require; require()"],
                          capture_output=True, text=True, cwd=REPO)
    if proc.returncode == 0:
        return None
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit {proc.returncode}"


# -- the workload ---------------------------------------------------------------------------------------------
def workload(count: int, max_input: int, max_seq: int, quick: bool, vocab: int, seed: int = 0,
             kind: str = "random") -> list[dict[str, Any]]:
    """`count` requests. random: prompts of 256-1024 tokens, 128 out (quick: 4-24 and 4-24); shared-prefix: one
    1000-token system prompt (quick: 24) and a 64-token question (quick: 4) each, 128 out (quick: 8). Clipped
    to the engine's shapes; token ids seeded, the same for every run."""
    rng = random.Random(seed)
    if kind == "shared-prefix":
        system_len, q_len, o = (24, 4, 8) if quick else (SYSTEM_PROMPT, QUESTION, OUT)
        system = [random.Random(7).randrange(min(vocab, 1000)) for _ in range(min(system_len, max_input - q_len))]
        return [{"prompt": system + [rng.randrange(min(vocab, 1000)) for _ in range(q_len)],
                 "max_tokens": max(1, min(o, max_seq - len(system) - q_len))} for _ in range(count)]
    p_lo, p_hi, o_lo, o_hi = (4, 24, 4, 24) if quick else (256, 1024, OUT, OUT)
    out = []
    for _ in range(count):
        p = min(rng.randint(p_lo, p_hi), max_input)
        o = max(1, min(rng.randint(o_lo, o_hi), max_seq - p))
        out.append({"prompt": [rng.randrange(min(vocab, 1000)) for _ in range(p)], "max_tokens": o})
    return out


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


# -- the server process ------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(port: int, path: str, timeout: float = 10.0) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def start_server(recipe: Path, engines: str, port: int, max_queue: int, log: Path, timeout: float,
                 flags: list[str] | None = None) -> subprocess.Popen:
    # not --quiet: the log keeps the server's startup block (its KV capacity, how a step's calls go)
    cmd = [sys.executable, "-m", "trtbuild", "serve", str(recipe), "--engines", engines, "--no-build",
           "--port", str(port), "--max-queue", str(max_queue), *(flags or [])]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=REPO)
    t = time.perf_counter()
    try:
        while time.perf_counter() - t < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited ({proc.returncode}): {log.read_text()[-2000:]}")
            try:
                if get(port, "/health", 2.0)[0] == 200:
                    return proc
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server was not ready after {timeout:.0f} s: {log.read_text()[-2000:]}")
    except BaseException:  # not ready, or this run ended while it loaded: no server is left behind
        proc.kill()
        proc.wait()
        raise


def exit_on_sigterm() -> None:
    """`timeout` and the gate end a run with SIGTERM: raised as SystemExit, so that each `finally` stops its
    server. A server left behind had held 76 GiB of an H100 (an 8B), and the next run's server could not load."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def stop_server(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)  # drains: every request has ended by now
    try:
        return proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def scrape(port: int) -> dict[str, float]:
    """/metrics as {'name{labels}': value} (Prometheus' text format, samples only)."""
    status, text = get(port, "/metrics")
    if status != 200:
        raise RuntimeError(f"/metrics answered {status}")
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


class Peak:
    """The most requests running at once during a level: /metrics' `trtbuild_running_requests` read every
    0.1 s from a thread of its own (a level shorter than that reads 0)."""

    def __init__(self, port: int) -> None:
        self.port, self.running = port, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.wait(0.1):
            try:
                self.running = max(self.running, int(scrape(self.port).get("trtbuild_running_requests", 0)))
            except (OSError, RuntimeError, ValueError):
                continue

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# -- the clients ----------------------------------------------------------------------------------------------------
class Clients:
    """N threads sending the workload's requests back to back; each request's timings as the client sees them."""

    def __init__(self, port: int, model: str, requests: list[dict[str, Any]]) -> None:
        self.port, self.model, self.todo = port, model, list(enumerate(requests))
        self.lock = threading.Lock()
        self.awaiting_first = 0  # requests sent that have no first token yet
        self.results: list[dict[str, Any]] = []
        self.started = time.perf_counter()  # run()'s start: each request's `sent_s` counts from it

    def run(self, n: int) -> float:
        threads = [threading.Thread(target=self._client) for _ in range(n)]
        t = self.started = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return time.perf_counter() - t

    def _client(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        while True:
            with self.lock:
                if not self.todo:
                    break
                i, req = self.todo.pop(0)
            try:
                self.results.append(self._one(conn, i, req))
            except (OSError, http.client.HTTPException, RuntimeError) as exc:
                self.results.append({"i": i, "error": f"{type(exc).__name__}: {exc}"})
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        conn.close()

    def _one(self, conn: http.client.HTTPConnection, i: int, req: dict[str, Any]) -> dict[str, Any]:
        body = json.dumps({"model": self.model, "prompt": req["prompt"], "max_tokens": req["max_tokens"],
                           "temperature": 0.0, "stream": True, "ignore_eos": True, "return_token_ids": True,
                           "stream_options": {"include_usage": True}})
        with self.lock:
            ahead = self.awaiting_first
            self.awaiting_first += 1
        first = None
        try:
            t0 = time.perf_counter()
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
            times: list[float] = []
            usage = None
            while True:
                line = resp.readline()
                if not line:
                    break
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(str(chunk["error"]))
                now = time.perf_counter()
                for choice in chunk.get("choices", []):
                    for _ in choice.get("token_ids") or []:
                        times.append(now)
                        if first is None:
                            first = now
                            with self.lock:
                                self.awaiting_first -= 1
                usage = chunk.get("usage") or usage
            resp.read()
        finally:
            if first is None:
                with self.lock:
                    self.awaiting_first -= 1
        if not times:
            raise RuntimeError("no token came back")
        n = len(times)
        return {"i": i, "sent_s": t0 - self.started, "prompt": len(req["prompt"]), "tokens": n,
                "expected": req["max_tokens"], "ahead": ahead,
                "ttft_s": times[0] - t0, "tpot_s": (times[-1] - times[0]) / (n - 1) if n > 1 else None,
                "usage": usage}


# -- one recipe ---------------------------------------------------------------------------------------------------------
def serving_recipe(path: Path, rows: int | None, folder: Path, paged: bool = False) -> tuple[Path, dict[str, Any]]:
    """The recipe as given, or a copy with `rows` cache rows and decode buckets 1, 8, 16, 32, ... up to it, and
    with `paged` the paged graph (options.kv_cache paged)."""
    doc = yaml.safe_load(path.read_text())
    if rows is None and not paged:
        return path, doc
    if paged:
        doc["name"] = f"{doc['name']}-paged"
        doc.setdefault("options", {})["kv_cache"] = "paged"
    rows = rows or doc["shapes"]["max_batch_size"]
    doc["name"] = f"{doc['name']}-rows{rows}"
    doc["shapes"]["max_batch_size"] = rows
    doc["shapes"]["batch_buckets"] = sorted({1, *(b for b in (8, 16, 32, 64, 128, 256) if b < rows), rows})
    source = doc["model"]["source"]
    if source.startswith((".", "/")) or (path.parent / source).exists():  # a local folder, relative to the recipe
        doc["model"]["source"] = str((path.parent / source).resolve())
    out = folder / f"{doc['name']}.yaml"
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out, doc


def measure_ceilings(engines: str) -> dict[str, Any]:
    code = ("import json, sys, torch; from pathlib import Path; from trtbuild.measure import ceilings; "
            "dev = 'cuda' if torch.cuda.is_available() else 'cpu'; "
            "print(json.dumps(ceilings.cached(dev, Path(sys.argv[1])) | {'device': dev}))")
    proc = subprocess.run([sys.executable, "-c", code, str(Path(engines) / "ceilings")], capture_output=True,
                          text=True, cwd=REPO, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def workload_floor(reqs: list[dict[str, Any]], cfg: dict[str, Any], weight_bytes: float, kv_per_token: float,
                   ceilings: dict[str, Any], concurrency: int) -> float:
    """Seconds the workload needs at least: every prompt token's matmul FLOPs (2 x parameters, plus causal
    attention) at the measured matmul rate, plus the decode steps' bytes at the copy rate, where a step of
    `concurrency` rows reads the weights once and each row its KV cache."""
    d, layers = cfg.get("hidden_size", 0), cfg.get("num_hidden_layers", 0)
    params = weight_bytes / 2  # 16-bit weights: the floor of the bf16 engines the targets are set for
    flops = sum(2 * params * len(r["prompt"]) + 2 * layers * d * len(r["prompt"]) ** 2 for r in reqs)
    out_tokens = sum(r["max_tokens"] for r in reqs)
    steps = out_tokens / max(1, concurrency)
    context = sum(r["max_tokens"] * (len(r["prompt"]) + r["max_tokens"] / 2) for r in reqs)
    return flops / ceilings["matmul_flops_per_s"] + (steps * weight_bytes + context * kv_per_token) / ceilings["copy_Bps"]


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} ms"


def ttft_waves(results: list[dict[str, Any]], clients: int) -> dict[str, Any]:
    """Where a level's TTFT comes from: the p50 of the first wave (each client's first request, all sent at
    once, the whole wave's prompts queued for the prefill budget together) against the requests after it,
    the p50 and p99 of how many requests were waiting for their first token when each was sent, and each
    request as [sent s, prompt tokens, waiting ahead, TTFT ms, TPOT ms or None]."""
    ok = sorted((r for r in results if "error" not in r), key=lambda r: r["sent_s"])
    first, rest = ok[:clients], ok[clients:]

    def p50(rs: list[dict[str, Any]]) -> float | None:
        return percentile([r["ttft_s"] for r in rs], 50) * 1e3 if rs else None

    ahead = [r["ahead"] for r in ok]
    return {"ttft_ms_first_wave_p50": p50(first), "ttft_ms_after_p50": p50(rest),
            "ahead": {"p50": percentile(ahead, 50), "p99": percentile(ahead, 99)} if ahead else None,
            "per_request": [[round(r["sent_s"], 4), r["prompt"], r["ahead"], round(r["ttft_s"] * 1e3, 2),
                             None if r["tpot_s"] is None else round(r["tpot_s"] * 1e3, 3)] for r in ok]}


def level_figures(results: list[dict[str, Any]], wall: float, before: dict[str, float], after: dict[str, float],
                  ceilings: dict[str, Any], lone: dict[str, float] | None) -> dict[str, Any]:
    ok = [r for r in results if "error" not in r]
    tokens = sum(r["tokens"] for r in ok)
    ttft = [r["ttft_s"] for r in ok]
    tpot = [r["tpot_s"] for r in ok if r["tpot_s"] is not None]
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    steps: dict[str, Any] = {}
    weights, per_token = after.get("trtbuild_engine_weight_bytes", 0.0), after.get("trtbuild_engine_kv_bytes_per_token", 0.0)
    for key, count in d.items():
        if key.startswith("trtbuild_decode_step_seconds_count{") and count > 0:
            label = key[key.index("{"):]
            bucket = label.split('"')[1]
            mean = d[f"trtbuild_decode_step_seconds_sum{label}"] / count
            rows = d.get(f"trtbuild_decode_rows_total{label}", 0.0) / count
            ctx = d.get(f"trtbuild_decode_context_tokens_total{label}", 0.0) / count
            floor = (weights + per_token * ctx) / ceilings["copy_Bps"] if weights else None
            steps[bucket] = {"steps": int(count), "mean_ms": mean * 1e3, "mean_rows": rows, "mean_context": ctx,
                             "floor_ms": floor * 1e3 if floor else None, "x_floor": mean / floor if floor else None}
    occ_n = d.get("trtbuild_batch_occupancy_count", 0.0)
    fig: dict[str, Any] = {
        "requests": len(results), "errors": [r["error"] for r in results if "error" in r][:5],
        "short": sum(1 for r in ok if r["tokens"] != r["expected"]),
        "wall_s": wall, "output_tokens": tokens, "output_tok_per_s": tokens / wall if wall else 0.0,
        "ttft_ms": {"p50": percentile(ttft, 50) * 1e3, "p99": percentile(ttft, 99) * 1e3},
        "tpot_ms": {"p50": percentile(tpot, 50) * 1e3, "p99": percentile(tpot, 99) * 1e3},
        "occupancy_mean": d.get("trtbuild_batch_occupancy_sum", 0.0) / occ_n if occ_n else None,
        # the launched steps' device time over the level's wall: below 1, the device waited for the host (CUDA)
        "device_busy": d.get("trtbuild_device_busy_seconds_total", 0.0) / wall if wall else None,
        "decode_steps": steps,
        "preemptions": d.get("trtbuild_preemptions_total", 0.0),
        "prefix_hits": d.get('trtbuild_prefix_cache_blocks_total{result="hit"}', 0.0),
        "prefix_misses": d.get('trtbuild_prefix_cache_blocks_total{result="miss"}', 0.0),
    }
    if lone is not None and ok:
        # the target: 2x a lone request's TTFT plus one lone prefill per request ahead of it in the queue
        ratios = [r["ttft_s"] / (2 * lone["ttft_s"] + r["ahead"] * lone["ttft_s"]) for r in ok]
        fig["ttft_vs_bound"] = {"p50": percentile(ratios, 50), "p99": percentile(ratios, 99),
                                "met": percentile(ratios, 99) <= 1.0}
    return fig


def bench_recipe(path: Path, args: argparse.Namespace, ceilings: dict[str, Any], folder: Path, res: dict[str, Any],
                 save: Callable[[], None]) -> None:
    """Fill `res` with one recipe's figures, saving after each level (a run cut off keeps what it measured)."""
    recipe, doc = serving_recipe(path, args.rows, folder, args.paged)
    name = doc["name"]
    print(f"[serve_bench] {name}: build or find the engine ...", flush=True)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "trtbuild", "build", str(recipe), "--engines", args.engines, "--quiet"],
                   check=True, cwd=REPO)
    shapes = doc["shapes"]
    vocab = int(doc["model"].get("config", {}).get("vocab_size", 1000))
    res.update({"recipe": name, "path": str(path), "rows": shapes["max_batch_size"],
                "buckets": shapes.get("batch_buckets"), "build_or_lookup_s": time.perf_counter() - t, "levels": {}})
    port = free_port()
    log = Path(args.out) / f"server-{name}.log"
    t = time.perf_counter()
    proc = start_server(recipe, args.engines, port, max_queue=4096, log=log, timeout=args.load_timeout,
                        flags=args.serve_flags.split())
    res["load_and_warm_s"] = time.perf_counter() - t
    lone = None
    try:
        # untimed: the first requests' one-time costs (allocator growth, first kernels of each prompt length)
        Clients(port, name, workload(4, shapes["max_input_len"], shapes["max_seq_len"], args.quick, vocab, seed=99)).run(2)
        for n in args.concurrency:
            count = max(n * args.requests_per_client, args.min_requests)
            reqs = workload(count, shapes["max_input_len"], shapes["max_seq_len"], args.quick, vocab, seed=n,
                            kind=args.workload)
            clients = Clients(port, name, reqs)
            before = scrape(port)
            with Peak(port) as peak:
                wall = clients.run(n)
            after = scrape(port)
            fig = level_figures(clients.results, wall, before, after, ceilings, lone)
            fig["peak_running"] = peak.running
            fig |= ttft_waves(clients.results, n)
            floor = workload_floor(reqs, doc["model"].get("config", {}) or {}, after.get("trtbuild_engine_weight_bytes", 0.0),
                                   after.get("trtbuild_engine_kv_bytes_per_token", 0.0), ceilings, n)
            fig["floor_s"], fig["fraction_of_floor"] = floor, floor / wall if wall else None
            if n == 1 and not fig["errors"]:
                lone = {"ttft_s": fig["ttft_ms"]["p50"] / 1e3}
            res["levels"][str(n)] = fig
            save()
            print(f"[serve_bench]   N={n}: {fig['output_tok_per_s']:.1f} tok/s, TTFT p50 {fig['ttft_ms']['p50']:.1f} ms "
                  f"p99 {fig['ttft_ms']['p99']:.1f} ms (p50 {_ms(fig['ttft_ms_first_wave_p50'])} in the first wave, "
                  f"{_ms(fig['ttft_ms_after_p50'])} after it), TPOT p50 {fig['tpot_ms']['p50']:.2f} ms, "
                  f"{len(fig['errors'])} errors", flush=True)
    finally:
        res["server_exit"] = stop_server(proc)
    if args.decode_bench:
        res["single_request_decode"] = decode_bench(path, args)


def decode_bench(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The existing benchmark's timed decode of the recipe as given (bench.py, the engine variant alone), in
    this run and on this device, once the server has exited: the single-request figures that serving must
    not slow down."""
    out = Path(args.out) / "decode-bench"
    cmd = [sys.executable, "benchmarks/bench.py", str(path), "--sections", "variants", "--variants", "engine",
           "--engines", args.engines, "--out", str(out)] + (["--quick"] if args.quick else [])
    print(f"[serve_bench] {path}: single-request decode (bench.py, engine variant) ...", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    try:
        rec = next(iter(json.loads((out / "bench.json").read_text())["recipes"].values()))
        decode = rec["variants"]["engine"]["decode"]
    except (OSError, ValueError, KeyError, StopIteration):
        return {"error": f"bench.py exited {proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}"}
    return {b: {"p50_ms": d["p50"] * 1e3, "x_floor": d.get("x_floor")} for b, d in decode.items()}


# -- report ---------------------------------------------------------------------------------------------------------------
def table(report: dict[str, Any]) -> str:
    lines = [f"serve_bench: {report['device_name']} ({report['device']}), copy {report['ceilings']['copy_Bps'] / 1e9:.1f} GB/s, "
             f"{report['date']}, commit {report['commit']}"]
    head = ["recipe", "N", "req", "peak", "tok/s", "x floor", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "occ", "busy",
            "TTFT/bound p99", "decode step ms (x floor) per bucket"]
    rows = [head]
    for rec in report["recipes"]:
        for n, f in rec["levels"].items():
            steps = ", ".join(f"b{b}: {s['mean_ms']:.3f} ({s['x_floor']:.2f}x, {s['mean_rows']:.1f} rows)"
                              if s["x_floor"] else f"b{b}: {s['mean_ms']:.3f}" for b, s in sorted(
                                  f["decode_steps"].items(), key=lambda kv: int(kv[0])))
            bound = f.get("ttft_vs_bound")
            frac = f.get("fraction_of_floor")
            rows.append([rec["recipe"], n, str(f["requests"]), str(f.get("peak_running", "-")),
                         f"{f['output_tok_per_s']:.1f}", "-" if frac is None else f"{frac:.2f}",
                         f"{f['ttft_ms']['p50']:.1f}", f"{f['ttft_ms']['p99']:.1f}", f"{f['tpot_ms']['p50']:.2f}",
                         f"{f['tpot_ms']['p99']:.2f}",
                         "-" if f["occupancy_mean"] is None else f"{f['occupancy_mean']:.2f}",
                         "-" if not f.get("device_busy") else f"{f['device_busy']:.2f}",
                         "-" if not bound else f"{bound['p99']:.2f} ({'met' if bound['met'] else 'NOT met'})", steps])
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(head) - 1)]
    for r in rows:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(r, widths)) + "  " + str(r[-1]))
    for rec in report["recipes"]:
        if "single_request_decode" in rec:
            lines.append(f"{rec['recipe']}: bench.py decode (single request, the recipe as given) "
                         f"{json.dumps(rec['single_request_decode'])}")
    lines.append("ms; TTFT and TPOT as the clients saw them; peak = most requests running at once; x floor = the "
                 "workload's floor / wall (1 is the floor); occ = running rows / bucket rows, mean over steps; "
                 "busy = the launched steps' device time / wall (CUDA); floor = (weights + filled KV cache) / copy bandwidth")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "[serve_bench] matplotlib is not importable here: no plot written (the JSON has every number)"
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for rec in report["recipes"]:
        ns = [int(n) for n in rec["levels"]]
        lv = list(rec["levels"].values())
        axes[0].plot(ns, [f["output_tok_per_s"] for f in lv], "o-", label=rec["recipe"])
        axes[1].plot(ns, [f["ttft_ms"]["p99"] for f in lv], "o-", label=f"{rec['recipe']} p99")
        axes[1].plot(ns, [f["ttft_ms"]["p50"] for f in lv], "o--", label=f"{rec['recipe']} p50")
        axes[2].plot(ns, [f["tpot_ms"]["p50"] for f in lv], "o-", label=f"{rec['recipe']} p50")
    for ax, title in zip(axes, ("output tokens/s", "TTFT ms", "TPOT ms")):
        ax.set(xlabel="concurrent streams", title=title, xscale="log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"trtbuild serve, {report['device_name']}, {report['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"[serve_bench] plot written: {path}"


def main() -> None:
    exit_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("recipes", nargs="+", type=Path)
    ap.add_argument("--engines", default=os.environ.get("TRTBUILD_ENGINES", "/tmp/bench-engines"))
    ap.add_argument("--out", default=os.environ.get("OUT", "serve-bench-out"))
    ap.add_argument("--concurrency", default=",".join(map(str, LEVELS)), help="comma list of client counts")
    ap.add_argument("--rows", type=int, default=None,
                    help="serve a copy of each recipe with this many cache rows (decode buckets 1, 8, 16, ... up to it); "
                         "default: the recipe's own max_batch_size")
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--min-requests", type=int, default=8, help="at least this many requests per level")
    ap.add_argument("--quick", action="store_true", help="short prompts and outputs (CPU smoke test)")
    ap.add_argument("--workload", choices=["random", "shared-prefix"], default="random")
    ap.add_argument("--paged", action="store_true", help="build with options.kv_cache paged and serve its block pool")
    ap.add_argument("--serve-flags", default="", help="more `trtbuild serve` flags, e.g. '--no-prefix-cache'")
    ap.add_argument("--decode-bench", action="store_true",
                    help="also run bench.py's timed decode of each recipe as given (engine variant) in this run")
    ap.add_argument("--load-timeout", type=float, default=900.0, help="seconds for the server to load and warm up")
    args = ap.parse_args()
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    if why := server_missing():
        sys.exit(f"serve_bench: trtbuild serve cannot start with this Python, nothing built or run: {why}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    ceilings = measure_ceilings(args.engines)
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit or "?",
                              "device": ceilings["device"], "device_name": ceilings.get("device_name", "?"),
                              "ceilings": ceilings, "command": " ".join(sys.argv), "recipes": []}
    def save() -> None:
        (out / "serve_bench.json").write_text(json.dumps(report, indent=1))

    with tempfile.TemporaryDirectory() as tmp:
        for path in args.recipes:
            res: dict[str, Any] = {"recipe": str(path), "levels": {}}
            report["recipes"].append(res)
            try:
                bench_recipe(path, args, ceilings, Path(tmp), res, save)
            except (RuntimeError, subprocess.CalledProcessError) as exc:
                res["error"] = str(exc)[-2000:]
                print(f"[serve_bench] {path}: {exc}", flush=True)
            save()
    print(plot(report, out / "serve_bench.png"))
    print(table(report))


if __name__ == "__main__":
    main()
