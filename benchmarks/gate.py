"""The GPU regression gate: a fixed matrix of figures, each against a floor measured in the same run, compared
with the card's baseline; a row more than 3% worse fails the gate (exit status 1).

    python3 benchmarks/gate.py --plan                                   # the steps, the parts, their seconds
    python3 benchmarks/gate.py --part 1 --seed benchmarks/results/2026-12-06-h100-gate-2 --out $OUT
    python3 benchmarks/gate.py --part 2 --out $OUT                      # same machine, warm: part 1's store
    python3 benchmarks/gate.py --part 3 --smollm2 /tmp/smollm2 --out $OUT   # paged serving, SmolLM2
    python3 benchmarks/gate.py --cpu-smoke --out /tmp/gate-smoke        # the plumbing on a CPU, tiny shapes

The matrix (docs/gate.md): the 1B bf16 engine's decode b1 / b8 and prefill 128 / 1024 / 2048 beside torch.compile
(max-autotune, CUDA graphs); the 1B fp8 and int4_wo engines' decode b1 / b8, also as tokens/s against bf16;
SmolLM2-135M-Instruct's bf16 greedy text against transformers' (benchmarks/greedy_match.py); `trtbuild
profile`'s decode step against `run`'s TPOT (benchmarks/profile_check.py); `trtbuild serve` under 16 streams
for 20 s (benchmarks/serve_bench.py's clients); `trtbuild serve` with the paged KV cache at 1-256 clients, and
its prefix cache's gain on a shared-prefix workload (serve_bench.py --paged); each engine's build time (`trtbuild build --json`). Every
measurement runs in a child process with a time limit taken from --budget, so a run cut off keeps the rows it
has: gate.json is written after every row. Writes gate.json, gate.png, gate.log and details.tar.gz (the
children's own reports and logs) under --out; with --save-seeds the tactic and torch.compile caches too.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import gate_report  # noqa: E402
from gate_report import row  # noqa: E402

BF16, FP8, INT4 = "recipes/llama-3.2-1b.yaml", "recipes/llama-3.2-1b-fp8.yaml", "recipes/llama-3.2-1b-int4.yaml"
TINY = "recipes/tiny-llama.yaml"
BF16_8B = "recipes/llama-3.1-8b.yaml"
SEED_PART = 15 << 20  # a returned file may have 16 MiB
STARTUP_S = 20.0  # a cold machine's first `import torch` and CUDA context (results/2026-12-06-h100-1b/session.log)


@dataclass(frozen=True)
class Step:
    name: str
    part: int
    cold_s: float  # a cold machine, no seeds
    seeded_s: float  # tactic and torch.compile caches seeded (--seed), or part 1's store still there
    basis: str  # where the estimate comes from


# In the order they run: in each part the longest, least predictable tail last (torch.compile's autotuning in
# part 1), so a cut-off costs the fewest rows. Estimates on an H100.
STEPS = {
    "build_bf16": Step("build 1B bf16", 1, 65, 60,
                       "results/2026-12-07-h100-gate-5: 54 s cold on a fresh H100 (matmul selection 22 s, "
                       "compile 23 s); "
                       "results/2026-12-07-h100-gate-2: 74 s cold on an H100 (matmul selection 27 s, compile 25 s); "
                       "results/2026-12-07-h100-gate: 107.7 s cold before CUDA builds skipped the vector-ISA checks; "
                       "results/2026-12-06-h100-gate-2: 105 s with the matmul timings seeded, the graphs compiled"),
    "profile": Step("profile step vs run TPOT", 1, 20, 15,
                    "results/2026-12-06-h100-gate-2: 11 s (load, one profile, one run of 128 tokens)"),
    "bench_bf16": Step("1B bf16 rows, engine and torch.compile", 1, 275, 215,
                       "results/2026-12-06-h100-gate: 271 s cold, -gate-2: 211 s, nearly all torch.compile's "
                       "max-autotune; a seeded Inductor cache skips the autotuning"),
    "serve": Step("serve 1B, 16 streams, 20 s", 2, 66, 55,
                  "results/2026-12-06-h100-gate-2: 54 s (server load and warm-up, 20 s of load, drain)"),
    "build_fp8": Step("build 1B fp8", 2, 70, 65,
                      "results/2026-12-07-h100-gate-5: 57 s after the bf16 build (selection 23 s, compile 24 s); "
                      "results/2026-12-06-h100-gate-3: 151 s on a fresh H100 before the compile's changes"),
    "build_int4": Step("build 1B int4_wo", 2, 70, 65,
                       "results/2026-12-07-h100-gate-5: 58 s cold after the fp8 build (selection 23 s, compile 25 s); "
                       "results/2026-12-07-h100-gate-3: 107 s cold (matmul selection 67 s, compile 29 s); "
                       "-2026-12-06-h100-gate-4: 196 s with the matmul timings seeded and its graphs compiled "
                       "(int8 down projections, new graphs); -gate-3: 182 s on a fresh H100"),
    "bench_quant": Step("1B fp8 / int4_wo / bf16 decode", 2, 20, 20,
                        "results/2026-12-06-h100-gate-2: 15 s (three cache hits)"),
    # not in a part: `--only` runs it where a change moves int4_wo alone (bench_quant has the same rows)
    "bench_int4": Step("1B int4_wo / bf16 decode", 0, 15, 15, "bench_quant's, without the fp8 engine"),
    # not in a part: where the int4_wo step's time goes, batch 1 and 8 (profile.json in details.tar.gz)
    "profile_int4": Step("profile the 1B int4_wo decode step", 0, 25, 25, "profile's, twice: estimated"),
    # not in a part: the int4_wo recipe with options.lm_head int8, built after it (its regions of the layers
    # before the last are the int4 engine's, reused), measured beside it and profiled
    "build_int4_head": Step("build 1B int4_wo, int8 LM head", 0, 135, 90,
                            "results/2026-12-07-h100-gate-3: 123 s cold, after the paged engine's build (matmul "
                            "selection 82 s, compile 31 s); results/2026-12-07-h100-gate: cut off at 140 s after the bf16 build (every quantized "
                            "site timed with its epilogue, every program compiled); seeded: estimated"),
    "bench_int4_head": Step("1B int4_wo / its int8 head / bf16 decode", 0, 20, 20, "bench_quant's, three engines"),
    "bench_quant_head": Step("1B fp8 / int4_wo / its int8 head / bf16 decode", 0, 25, 25, "bench_quant's, four engines"),
    "bench_head": Step("1B int4_wo with the int8 head / bf16 decode", 0, 15, 15, "bench_quant's, two engines"),
    "profile_int4_head": Step("profile the 1B int4_wo int8-head decode step", 0, 25, 25, "profile_int4's"),
    "serve_paged": Step("serve 1B paged: 1-256 clients, shared prefix", 3, 290, 190,
                        "results/2026-12-07-h100-gate-3: 240 s and 286 s on two machines, the paged engine built "
                        "cold in each (119 s on the first); results/2026-12-07-h100-gate-2: ~117 s building the paged engine (the paged and mixed "
                        "programs, 43 s each side by side, the others reused) and 78 s serving (three servers' load "
                        "and captures, four random levels, the shared prefix on and off)"),
    # not in a part: the captured mixed step (serve's default) against the direct call, taken in turn on one machine
    "serve_captured": Step("serve 1B paged, captured vs direct mixed step, 64 clients", 0, 150, 130,
                           "estimated: four servers' load and captures (~25 s each) and a 64-client level; the "
                           "paged engine built by serve_paged (~120 s more where it was not)"),
    # not in a part (a call of its own): the 8B served from its paged pool, 16 and 64 clients, the shared prefix
    "serve_8b": Step("serve 8B paged: 16 and 64 clients, shared prefix", 0, 480, 150,
                     "results/2026-12-08-h100-gate-1/8b-serve: its paged engine built cold in 365 s on a slow host "
                     "(Inductor 96 s; ~220 s on results/2026-12-07-h100-8b-serve's), then three servers of ~25-35 s "
                     "each (load, captures, the levels)"),
    "paged_probe": Step("paged chunk and decode step alone", 3, 20, 20,
                        "results/2026-12-07-h100-gate-2: 16 s (the paged engine found in the store)"),
    # not in a part: the GPU tests of the kernels and paths a change touched, run where the gate runs (`--only`)
    "gpu_tests": Step("GPU tests: quantized op, GPTQ loops, paged steps", 0, 100, 100,
                      "results/2026-12-07-h100-gate-5: 93 s (quantized op 25 s, GPTQ loops 9 s, the paged test 59 s); "
                      "results/2026-12-07-h100-gate-3: 89 s (the quantized op's 15 tests 32 s; the paged test 57 s, "
                      "a 2-layer paged bf16 engine built and its steps captured); results/2026-12-07-h100-quant-loops: "
                      "78 s (27 s and 50 s); the GPTQ loops' 3 tests not yet timed (~20 s guessed: a pytest start, "
                      "one kernel compile, the eager loops over 2,048 + 2,624 columns)"),
    # not in a part: GPTQ's column loops (a build's quantize phase) each way, at the 8B's shapes
    "gptq": Step("GPTQ's loops at the 8B's shapes: eager, captured, kernel", 0, 25, 25,
                 "results/2026-12-07-h100-gate-5: 17 s; before it ran, estimated: the eager loops over one 8B "
                 "layer's 26,624 columns twice (fp8, int4) at ~0.2 ms a column, the other ways in seconds"),
    # last, where its time is left
    "smollm2": Step("SmolLM2 greedy vs transformers", 3, 115, 115,
                    "results/2026-12-06-h100-gate-2: 111 s (unpack, a 135M engine at tactics level none, "
                    "transformers' generate)"),
}


# The steps whose rows move with the host's speed (compiling; a server's Python under load): judged beside it
# (gate_report.HOST_TOLERANCE)
HOST_BOUND = {"build_bf16", "build_fp8", "build_int4", "build_int4_head", "serve", "serve_paged", "serve_captured",
              "serve_8b"}


def plan_text(seeded: bool) -> str:
    lines = [f"{'part':<5} {'step':<42} {'cold s':>7} {'seeded s':>9}  basis"]
    for part in (1, 2, 3):
        steps = [s for s in STEPS.values() if s.part == part]
        for s in steps:
            lines.append(f"{part:<5} {s.name:<42} {s.cold_s:7.0f} {s.seeded_s:9.0f}  {s.basis}")
        cold = STARTUP_S + sum(s.cold_s for s in steps)
        warm = STARTUP_S + sum(s.seeded_s for s in steps)
        lines.append(f"{part:<5} {'total (with ' + str(int(STARTUP_S)) + ' s start-up)':<42} {cold:7.0f} {warm:9.0f}")
    total = STARTUP_S + sum(s.seeded_s for s in STEPS.values() if s.part)
    lines.append(f"all parts in one call, seeded: ~{total:.0f} s ({'fits' if total < 560 else 'does not fit'} "
                 "one 10-minute call): three calls, one a part, on one warm machine")
    lines.append(f"running now: {'seeded' if seeded else 'cold'} estimates")
    return "\n".join(lines)


# -- the run ----------------------------------------------------------------------------------------------------------
class Gate:
    """One run: its store, work folder, deadline and report; rows are judged and saved as they come."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.part = 1 if args.part == "all" else int(args.part)  # the part of the step running
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.budget
        self.store, self.work, self.out = Path(args.engines), Path(args.work), Path(args.out)
        for d in (self.store, self.work, self.out):
            d.mkdir(parents=True, exist_ok=True)
        self.log_file = (self.out / "gate.log").open("a")
        self.env = os.environ | {"PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                                 "PYTHONUNBUFFERED": "1",
                                 # the torch.compile peer's caches in a folder of their own, which --seed and
                                 # --save-seeds carry (device_session.sh's SEED_PEER_CACHE, the same layout)
                                 "TORCHINDUCTOR_CACHE_DIR": str(self.peer_cache / "inductor"),
                                 "TRITON_CACHE_DIR": str(self.peer_cache / "triton")}
        if args.cpu_smoke:
            self.env["CUDA_VISIBLE_DEVICES"] = ""  # the children build and run for the CPU
        self.baseline: dict[str, Any] | None = None
        self.report: dict[str, Any] = {}
        self.host_bound = False  # the running step's rows move with the host's speed

    @property
    def peer_cache(self) -> Path:
        return Path(self.args.work) / "peer-cache"

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, message: str) -> None:
        line = f"[gate +{time.monotonic() - self.t0:5.0f}s] {message}"
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def add(self, r: dict[str, Any]) -> None:
        """Judge a row against the baseline and save the report at once (a run cut off keeps it)."""
        if self.host_bound and self.report.get("host_s"):
            r = r | {"host_s": self.report["host_s"]}
        self.report["rows"] = [x for x in self.report["rows"] if x["name"] != r["name"]]
        self.report["rows"].append(gate_report.judge(r, {b["name"]: b for b in (self.baseline or {}).get("rows", [])}))
        self.save()

    def save(self) -> None:
        text = json.dumps(self.report, indent=1, default=str) + "\n"
        for path in (self.out / "gate.json", self.work / f"gate-part{self.report['part']}.json"):
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text)
            os.replace(tmp, path)

    def child(self, name: str, cmd: list[str], reserve: float) -> tuple[int | None, str]:
        """Run `cmd` in its own process group with what is left of the budget (less `reserve`); at the limit
        SIGTERM (bench.py then writes what it measured), the group killed 15 s later. Returns (status or None
        when cut off, its output)."""
        log = self.work / f"{name}.log"
        limit = max(5.0, self.left() - reserve)
        self.log(f"{name}: {' '.join(cmd)} (limit {limit:.0f} s)")
        with log.open("wb") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=self.env,
                                    start_new_session=True)
            try:
                rc: int | None = proc.wait(limit)
            except subprocess.TimeoutExpired:
                rc = None
                stop_group(proc)
            except BaseException:  # Stopped: the gate's own limit; the child must not outlive it
                stop_group(proc)
                raise
        text = log.read_text(errors="replace")
        self.log(f"{name}: {'cut off at its limit' if rc is None else f'exit {rc}'}")
        return rc, text


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """TERM the child, then KILL its whole group: Inductor's compile workers outlive a parent that was cut off."""
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


# -- the steps ----------------------------------------------------------------------------------------------------------
def recipes(g: Gate) -> dict[str, str]:
    """The recipes of the matrix; on the CPU smoke run the tiny Llama, and its quantized copies."""
    import yaml

    if not g.args.tiny:
        out = {"bf16": BF16, "fp8": FP8, "int4": INT4}
    else:
        out = {"bf16": TINY}
        doc = yaml.safe_load((REPO / TINY).read_text())
        for key, precision in (("fp8", "fp8"), ("int4", "int4_wo")):
            q = doc | {"name": f"{doc['name']}-{key}", "precision": precision}
            path = g.work / f"{q['name']}.yaml"
            path.write_text(yaml.safe_dump(q, sort_keys=False))
            out[key] = str(path)
    # int4_wo with its LM head in int8 (options.lm_head)
    doc = yaml.safe_load((REPO / out["int4"]).read_text() if not Path(out["int4"]).is_absolute()
                         else Path(out["int4"]).read_text())
    doc = doc | {"name": f"{doc['name']}-head8", "options": (doc.get("options") or {}) | {"lm_head": "int8"}}
    path = g.work / f"{doc['name']}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    out["int4_head"] = str(path)
    return out


def label(g: Gate) -> str:
    """The matrix's model in row names: the smoke run's rows are not the 1B's."""
    return "tiny" if g.args.tiny else "1B"


def build_step(g: Gate, key: str) -> None:
    path = recipes(g)[key]
    name = f"build {label(g)} {key}"
    # cold: no tactic cache in the store before this build (neither seeded nor left by an earlier part's builds)
    warm_store = any((g.store / "tactics").glob("torch/*/*"))
    rc, text = g.child(f"build-{key}", [sys.executable, "-m", "trtbuild", "build", path, "--engines", str(g.store),
                                        "--json", "--quiet"], reserve=g.args.reserve)
    try:
        result = json.loads(text.strip().splitlines()[-1])
    except (ValueError, IndexError):
        g.add(row(name, None, "s", g.part, status="error" if rc is not None else "not run",
                  note=f"{'cut off' if rc is None else f'exit {rc}'}: {text.strip()[-300:]}"))
        return
    manifest = Path(result["engine"]["path"]) / "manifest.json"
    reused = (json.loads(manifest.read_text()).get("tactics", {}).get("compiled_graphs_reused", [])
              if manifest.is_file() else [])
    hit = result["engine"]["cache_hit"]
    phases = ", ".join(f"{k.removesuffix('_s')} {v:.0f}" for k, v in result.get("phases", {}).items() if v >= 1)
    context = "seeded" if reused or g.args.seed or warm_store else "cold"
    if hit:
        g.add(row(name, None, "s", g.part, status="not run", context=context,
                  note="the engine was already in the store (a cache hit): its build time is that of the run that built it"))
        return
    # A build's time depends on the seeds (context) and on the host's load: compared at 25%, not 3%
    g.add(row(name, result["build_s"], "s", g.part, tolerance=0.25, context=context,
              note=f"{phases}" + (f"; compiled graphs reused: {', '.join(reused)}" if reused else "")))


def bench_step(g: Gate, name: str, paths: list[str], variants: str) -> dict[str, Any] | None:
    out = g.work / name
    shutil.rmtree(out, ignore_errors=True)
    rc, text = g.child(name, [sys.executable, "benchmarks/bench.py", *paths, "--sections", "variants", "--variants",
                              variants, "--engines", str(g.store), "--out", str(out)]
                       + (["--device", "cpu"] if g.args.cpu_smoke else []), reserve=g.args.reserve)
    try:
        return json.loads((out / "bench.json").read_text())
    except (OSError, ValueError):
        g.log(f"{name}: no bench.json: {text.strip()[-600:]}")
        return None


def _fig(variant: dict[str, Any] | None, kind: str, point: str) -> tuple[float | None, float | None]:
    d = (variant or {}).get(kind, {}).get(point)
    return (d["p50"] * 1e3, d.get("x_floor")) if d else (None, None)


def engine_rows(g: Gate, rec: dict[str, Any] | None, key: str, kinds: tuple[str, ...], peer: str | None,
                why_missing: str) -> dict[str, float]:
    """The engine's rows of one recipe's bench.py section (and `peer`'s beside them); returns decode ms by batch."""
    part = g.part
    variants = (rec or {}).get("variants", {})
    engine, other = variants.get("engine"), variants.get(peer) if peer else None
    floors = (rec or {}).get("floors", {})
    decode_ms: dict[str, float] = {}
    for kind in kinds:
        points = sorted(floors.get(f"{kind}_s", {}), key=int) or (["1", "8"] if kind == "decode" else ["128", "1024", "2048"])
        for point in points:
            name = f"{label(g)} {key} {'decode b' + point if kind == 'decode' else 'prefill ' + point}"
            ms, x = _fig(engine, kind, point)
            if ms is None:
                err = (engine or {}).get("error") or why_missing
                g.add(row(name, None, "ms", part, status="error" if (engine or {}).get("error") else "not run", note=err))
                continue
            pms, px = _fig(other, kind, point)
            note = ""
            if peer and pms is None:
                note = f"torch.compile: {(other or {}).get('skipped') or (other or {}).get('error') or 'not reached'}"
            g.add(row(name, ms, "ms", part, x_floor=x, note=note[:300],
                      peer={"name": "torch.compile", "value": pms, "x_floor": px} if pms is not None else None))
            if kind == "decode":
                decode_ms[point] = ms
    return decode_ms


def bench_bf16_step(g: Gate) -> None:
    path = recipes(g)["bf16"]
    report = bench_step(g, "bench-bf16", [path], "engine,compile")
    rec = (report or {}).get("recipes", {}).get(path)
    engine_rows(g, rec, "bf16", ("decode", "prefill"), "compile", "bench.py wrote no figure (see details.tar.gz)")


def bench_quant_step(g: Gate, keys: tuple[str, ...] = ("fp8", "int4")) -> None:
    r = recipes(g)
    report = bench_step(g, "bench-quant", [r["bf16"], *(r[k] for k in keys)], "engine")
    recs = (report or {}).get("recipes", {})
    bf16 = engine_rows(g, recs.get(r["bf16"]), "bf16 (quant run)", ("decode",), None, "not reached")
    for key in keys:
        mine = engine_rows(g, recs.get(r[key]), key, ("decode",), None, "not reached")
        for b, ms in mine.items():
            if b in bf16:  # the same batch: the ratio of times is the ratio of tokens/s
                g.add(row(f"{label(g)} {key} decode b{b} tok/s vs bf16", bf16[b] / ms, "x bf16", g.part,
                          note=f"bf16 {bf16[b]:.3f} ms against {ms:.3f} ms in the same run"))


def profile_step(g: Gate, key: str = "bf16", batches: str = "1") -> None:
    """`trtbuild profile` of the 1B `key` recipe's decode step at `batches`, against the TPOT `run` measures: a row
    for batch 1's agreement, noting where the step's time goes (the sites that take the most, and launches)."""
    out = g.work / f"profile-{key}"
    name = f"{label(g)} {key} profile kernels / run TPOT b1"
    rc, text = g.child(f"profile-{key}", [sys.executable, "benchmarks/profile_check.py", recipes(g)[key], "--engines",
                                          str(g.store), "--out", str(out), "--batches", batches, "--prefill-len", "0"]
                       + (["--prompt-len", "8", "--output-len", "16"] if g.args.tiny else []),
                       reserve=g.args.reserve)
    try:
        case = json.loads((out / "profile.json").read_text())["cases"]["decode_b1"]
        agree, decode = case["agreement"], case["profile"]["phases"]["decode"]
    except (OSError, ValueError, KeyError):
        g.add(row(name, None, "x TPOT", g.part, status="error" if rc is not None else "not run",
                  note=text.strip()[-300:]))
        return
    ratio = agree["kernel_ratio"]  # what the profile's rows account for of the step `run` measures
    top = ", ".join(f"{r['site']} {r['time_s'] * 1e3:.3f} ms" for r in decode["rows"][:4])
    g.add(row(name, ratio, "x TPOT", g.part, target="within 5%", met=abs(ratio - 1) <= 0.05,
              note=f"profile step {agree['profile_step_ms']:.4f} ms ({agree['ratio']:.3f}x TPOT), its kernels "
                   f"{agree['profile_kernels_ms']:.4f} ms, {agree['profiled_wall_ms']:.4f} ms under the profiler; "
                   f"run TPOT p50 {agree['run_tpot_p50_ms']:.4f} ms; {decode['launches']:.0f} launches; most: {top}"))


def serve_step(g: Gate) -> None:
    """`trtbuild serve` of the bf16 recipe as it is, `--streams` closed-loop clients for `--serve-s` seconds
    (serve_bench.py's server handling, workload and clients)."""
    import serve_bench

    part, streams, seconds = g.part, g.args.streams, g.args.serve_s
    prefix = f"{label(g)} serve {streams} streams"
    names = (f"{prefix} output tok/s", f"{prefix} TTFT p50", f"{prefix} TTFT p99")
    path = REPO / recipes(g)["bf16"]
    if g.left() < seconds + 60:
        for n, unit in zip(names, ("tok/s", "ms", "ms"), strict=True):
            g.add(row(n, None, unit, part, status="not run", note=f"{g.left():.0f} s left"))
        return
    import yaml

    doc = yaml.safe_load(path.read_text())
    shapes, model, vocab = doc["shapes"], doc["name"], int(doc["model"]["config"]["vocab_size"])
    quick = g.args.tiny
    try:
        rc, text = g.child("serve-build", [sys.executable, "-m", "trtbuild", "build", str(path), "--engines",
                                           str(g.store), "--quiet"], reserve=g.args.reserve + seconds + 30)
        if rc != 0:
            raise RuntimeError(f"build: {text.strip()[-300:]}")
        port = serve_bench.free_port()
        proc = serve_bench.start_server(path, str(g.store), port, max_queue=4096, log=g.work / "server.log",
                                        timeout=max(30.0, g.left() - seconds - 30))
    except (RuntimeError, OSError) as exc:
        for n, unit in zip(names, ("tok/s", "ms", "ms"), strict=True):
            g.add(row(n, None, unit, part, status="error", note=str(exc)[-300:]))
        return
    try:
        # untimed: the first requests' one-time costs (as serve_bench.py does)
        serve_bench.Clients(port, model, serve_bench.workload(4, shapes["max_input_len"], shapes["max_seq_len"],
                                                                 quick, vocab, seed=99)).run(2)
        clients = serve_bench.Clients(port, model, serve_bench.workload(
            100_000, shapes["max_input_len"], shapes["max_seq_len"], quick, vocab, seed=streams))

        def close() -> None:  # no request starts after the window; those running finish and count
            with clients.lock:
                clients.todo.clear()

        timer = threading.Timer(seconds, close)
        timer.start()
        wall = clients.run(streams)
        timer.cancel()
        fig = serve_bench.level_figures(clients.results, wall, {}, {}, {"copy_Bps": 1.0}, None)
    finally:
        serve_bench.stop_server(proc)
    # each request's send time, TTFT and how many were awaiting a first token ahead of it: where a tail comes from
    fig["each"] = [{k: r[k] for k in ("sent_s", "prompt", "ahead", "ttft_s", "tpot_s") if k in r}
                   for r in clients.results if "error" not in r]
    (g.work / "serve.json").write_text(json.dumps(fig, indent=1) + "\n")
    note = (f"{fig['requests']} requests in {fig['wall_s']:.1f} s, {fig['output_tokens']} tokens, "
            f"{len(fig['errors'])} errors, on the recipe's {shapes['max_batch_size']} rows")
    status = "error" if fig["errors"] else "ok"
    g.add(row(names[0], fig["output_tok_per_s"], "tok/s", part, status=status, note=note))
    g.add(row(names[1], fig["ttft_ms"]["p50"], "ms", part, status=status))
    g.add(row(names[2], fig["ttft_ms"]["p99"], "ms", part, status=status))


def paged_serve_bench(g: Gate, key: str, path: str, workload: str, conc: str, flags: str) -> dict[str, Any]:
    """serve_bench.py --paged of one workload at the `conc` client counts with `flags` for serve: its levels by
    client count, or {"error": why}."""
    out = g.work / f"serve-paged-{key}"
    shutil.rmtree(out, ignore_errors=True)
    rc, text = g.child(f"serve-paged-{key}", [
        sys.executable, "benchmarks/serve_bench.py", path, "--paged", "--engines", str(g.store), "--out", str(out),
        "--workload", workload, "--concurrency", conc, f"--serve-flags={flags}",
        "--load-timeout", str(max(30, int(g.left() - 60)))] + (["--quick"] if g.args.tiny else []),
        reserve=g.args.reserve)
    try:
        rec = json.loads((out / "serve_bench.json").read_text())["recipes"][0]
        return rec["levels"] | ({"error": rec["error"]} if "error" in rec else {})
    except (OSError, ValueError, IndexError, KeyError):
        return {"error": f"{'cut off' if rc is None else f'exit {rc}'}: {text.strip()[-300:]}"}


def serve_captured_step(g: Gate) -> None:
    """serve's default, the launched mixed step replayed from its captured graphs, against the mixed step called
    directly (`--no-captured-mixed`) on the same machine, the random workload at 64 clients (8 with --smoke),
    two servers each, taken in turn: each one's mean tok/s, and the ratio."""
    path = recipes(g)["bf16"]
    n = "8" if g.args.tiny else "64"
    got: dict[str, list[float]] = {"captured": [], "direct": []}
    notes: list[str] = []
    for i in range(2):
        for mode, flags in (("captured", ""), ("direct", "--no-captured-mixed")):
            f = paged_serve_bench(g, f"{mode}-{i}", path, "random", n, flags).get(n)
            if f and f.get("requests") and not f.get("errors"):
                got[mode].append(f["output_tok_per_s"])
                notes.append(f"{mode} {f['output_tok_per_s']:.0f} tok/s, TPOT p50 {f['tpot_ms']['p50']:.2f} ms"
                             + (f", busy {f['device_busy']:.2f}" if f.get("device_busy") else ""))
    tag = f"{label(g)} paged serve {n} clients, captured mixed step"
    mean = {mode: sum(v) / len(v) if v else None for mode, v in got.items()}
    note = "; ".join(notes) or "no level ran"
    g.add(row(f"{tag}: output tok/s", mean["captured"], "tok/s", g.part, note=note,
              status="ok" if mean["captured"] else "error"))
    ok = bool(mean["captured"] and mean["direct"])
    g.add(row(f"{tag}: tok/s vs the mixed step called directly", mean["captured"] / mean["direct"] if ok else None,
              "x gain", g.part, note=note, status="ok" if ok else "error"))


def serve_paged_step(g: Gate) -> None:
    """`trtbuild serve` of the bf16 recipe with the paged KV cache (serve_bench.py --paged): the random workload at
    1, 16, 64 and 256 clients, and the shared-prefix one at 64 clients with the prefix cache on and off."""
    levels = "1,4,8" if g.args.tiny else "1,16,64,256"
    paged_serving_rows(g, recipes(g)["bf16"], f"{label(g)} paged serve", levels, levels.split(",")[-2], work="")


def serve_8b_step(g: Gate) -> None:
    """The 8B bf16 recipe served from its paged pool: the random workload at 16 and 64 clients, the shared prefix
    at 64 with the prefix cache on and off, and at 64 clients the TTFT p50 (<= 100 ms) and the time between a
    stream's tokens against the decode step's floor (p99 <= 1.5x). The smoke run serves the tiny recipe."""
    levels = "4,8" if g.args.tiny else "16,64"
    paged_serving_rows(g, TINY if g.args.tiny else BF16_8B, "tiny paged serve (8B step)" if g.args.tiny else
                       "8B paged serve", levels, levels.split(",")[-1], work="8b-", ttft_ms=100.0, between=1.5)


def paged_serving_rows(g: Gate, path: str, tag: str, levels: str, at: str, work: str, ttft_ms: float | None = None,
                       between: float | None = None) -> None:
    """serve_bench.py --paged of `path`: the random workload at each of `levels` (0.6 of the floor the target at
    `at`; the last level's clients all running at once), the shared prefix at `at` on and off, and optionally at
    `at` the TTFT p50 against `ttft_ms` and the TPOT p99 against `between` x the decode step's floor. `work`
    prefixes the children's folders."""
    top = levels.split(",")[-1]
    runs = {"random": ("random", levels, ""), "prefix": ("shared-prefix", at, ""),
            "no-prefix": ("shared-prefix", at, "--no-prefix-cache")}
    figs = {key: paged_serve_bench(g, f"{work}{key}", path, workload, conc, flags)
            for key, (workload, conc, flags) in runs.items()}

    def level(key: str, n: str) -> dict[str, Any] | None:
        f = figs.get(key, {}).get(n)
        return f if f and not f.get("errors") and f.get("requests") else None

    def missing(key: str, n: str) -> tuple[str, str]:
        f, err = figs.get(key, {}).get(n), figs.get(key, {}).get("error")
        if f and f.get("errors"):
            return "error", f"{len(f['errors'])}+ failed requests: {f['errors'][0][:200]}"
        return ("error", err[-300:]) if err else ("not run", "this level was not reached")

    for n in levels.split(","):
        name = f"{tag} {n} clients output tok/s"
        f = level("random", n)
        if f is None:
            status, note = missing("random", n)
            g.add(row(name, None, "tok/s", g.part, status=status, note=note))
            continue
        frac = f.get("fraction_of_floor")
        g.add(row(name, f["output_tok_per_s"], "tok/s", g.part, target="0.6 of the workload's floor" if n == at else "",
                  met=(frac >= 0.6) if n == at and frac is not None else None,
                  note=f"{frac:.2f} of the workload's floor; TTFT p50 {f['ttft_ms']['p50']:.0f} ms, p99 "
                       f"{f['ttft_ms']['p99']:.0f} ms; TPOT p50 {f['tpot_ms']['p50']:.2f} ms; peak running "
                       f"{f.get('peak_running')}; {f['requests']} requests; preemptions {f['preemptions']:.0f}"
                       + (f"; device busy {f['device_busy']:.2f}" if f.get("device_busy") else "")))
    f = level("random", top)
    name = f"{tag} {top} clients: most requests running at once"
    if f is None:
        status, note = missing("random", top)
        g.add(row(name, None, "requests", g.part, status=status, note=note))
    else:
        g.add(row(name, f.get("peak_running"), "requests", g.part, target=f"{top} at once",
                  met=(f.get("peak_running") or 0) >= int(top), note="/metrics' running requests, read every 0.1 s"))
    f = level("random", at)
    status, note = ("ok", "") if f else missing("random", at)
    if ttft_ms is not None:
        name = f"{tag} {at} clients TTFT p50"
        if f is None:
            g.add(row(name, None, "ms", g.part, status=status, note=note))
        else:
            g.add(row(name, f["ttft_ms"]["p50"], "ms", g.part, target=f"<= {ttft_ms:g} ms",
                      met=f["ttft_ms"]["p50"] <= ttft_ms,
                      note=f"{f.get('ttft_ms_first_wave_p50') or 0:.0f} ms in the first wave, "
                           f"{f.get('ttft_ms_after_p50') or 0:.0f} after it"))
    if between is not None:
        name = f"{tag} {at} clients: TPOT p99 over the decode step's floor"
        steps = (f or {}).get("decode_steps") or {}
        widest = max(steps, key=int) if steps else None
        floor = steps[widest].get("floor_ms") if widest else None
        if f is None:
            g.add(row(name, None, "x step floor", g.part, status=status, note=note))
        elif not floor:
            g.add(row(name, None, "x step floor", g.part, status="not run",
                      note="no decode step's floor (a device's copy rate and the engine's bytes)"))
        else:
            ratio = f["tpot_ms"]["p99"] / floor
            g.add(row(name, ratio, "x step floor", g.part, target=f"<= {between:g}x", met=ratio <= between,
                      note=f"TPOT p99 {f['tpot_ms']['p99']:.2f} ms; the b{widest} step's floor {floor:.2f} ms "
                           f"(its mean {steps[widest]['mean_ms']:.2f} ms at {steps[widest]['mean_rows']:.1f} rows)"))
            # the same p99 against a step that also prefills its share of the workload's prompts (docs/serve.md:
            # at this throughput each step must): the workload's floor a token times the step's rows
            mean_rows = steps[widest]["mean_rows"]
            if f.get("floor_s") and f.get("output_tokens") and mean_rows:
                share = f["floor_s"] / f["output_tokens"] * mean_rows * 1e3
                g.add(row(f"{tag} {at} clients: TPOT p99 over the workload's step floor", f["tpot_ms"]["p99"] / share,
                          "x step floor", g.part,
                          note=f"the workload's floor a token (its prompts' FLOPs and its decode bytes) x "
                               f"{mean_rows:.1f} rows: {share:.2f} ms a step"))
    on, off = level("prefix", at), level("no-prefix", at)
    for what, unit_key, target in (("TTFT p50", "ttft", 3.0), ("output tok/s", "tput", 2.0)):
        name = f"{tag} shared prefix {at} clients: {what} gain from the prefix cache"
        if on is None or off is None:
            key = "prefix" if on is None else "no-prefix"
            status, note = missing(key, at)
            g.add(row(name, None, "x gain", g.part, status=status, note=note))
            continue
        gain = (off["ttft_ms"]["p50"] / on["ttft_ms"]["p50"] if unit_key == "ttft"
                else on["output_tok_per_s"] / off["output_tok_per_s"])
        g.add(row(name, gain, "x gain", g.part, target=f">= {target:g}x", met=gain >= target,
                  note=f"with: TTFT p50 {on['ttft_ms']['p50']:.0f} ms, {on['output_tok_per_s']:.0f} tok/s, "
                       f"{on['prefix_hits']:.0f} block hits; without: {off['ttft_ms']['p50']:.0f} ms, "
                       f"{off['output_tok_per_s']:.0f} tok/s" + "".join(
                           f"; {side} TTFT p50 {f['ttft_ms_first_wave_p50']:.0f} ms in the first wave, "
                           f"{f['ttft_ms_after_p50']:.0f} after it" for side, f in (("with", on), ("without", off))
                           if f.get("ttft_ms_first_wave_p50") is not None and f.get("ttft_ms_after_p50") is not None)))


# The wall time of a paged step moves between processes on one machine while its kernels do not: at 4a91d4f the
# 64-row decode step took 2.553 ms and 2.240 ms in two runs minutes apart on one H100, its kernels 1.927 and
# 1.924 ms; at b9a9c92, 1.770 and 1.550 ms at one row in two runs back to back (results/2026-12-07-h100-gate-3/,
# -gate-4/). So each step is also judged on its kernels' device time (CUPTI's sum), which a kernel or graph
# change moves and the host does not, and its wall time only past a wider tolerance.
PAGED_WALL_TOLERANCE = 0.15
PAGED_KERNELS_TOLERANCE = 0.05  # the kernels' sums of one commit on two H100s: within 3.2%


def paged_probe_step(g: Gate) -> None:
    """benchmarks/paged_probe.py on the bf16 recipe's paged engine (serve_paged built it): a 512-token prompt chunk
    after 1,024 tokens beside the prefill graph on the same tokens, decode steps of 64 and 256 rows, and 64 decode
    rows with a 512-token chunk in one call of the mixed step (two calls in the row's note)."""
    out = g.work / "paged-probe"
    shutil.rmtree(out, ignore_errors=True)
    quick = ["--chunks", "8,32", "--contexts", "0,16", "--rows", "1,4", "--decode-context", "40", "--together", "2x8",
             "--mixed", "4x16"] if g.args.tiny else []
    rc, text = g.child("paged-probe", [sys.executable, "benchmarks/paged_probe.py", recipes(g)["bf16"], "--engines",
                                       str(g.store), "--out", str(out), *quick], reserve=g.args.reserve)
    try:
        report = json.loads((out / "paged_probe.json").read_text())
    except (OSError, ValueError):
        chunk_len, context = (32, 16) if g.args.tiny else (512, 1024)
        g.add(row(f"{label(g)} paged prompt chunk {chunk_len} after {context}", None, "ms", g.part,
                  status="error" if rc is not None else "not run", note=text.strip()[-300:]))
        return
    for r in paged_rows(report, label(g), g.part, g.args.tiny):
        g.add(r)


def paged_rows(report: dict[str, Any], model: str, part: int, tiny: bool) -> list[dict[str, Any]]:
    """The gate's rows of one paged_probe.json: each step's wall time, and beside it its kernels' device time
    where the probe profiled it (on a GPU)."""
    chunk_len, context, rows = (32, 16, ("4",)) if tiny else (512, 1024, ("64", "256"))
    out: list[dict[str, Any]] = []

    def timed(name: str, ms: float, split: dict[str, Any] | None, note: str, floor_ms: float | None = None) -> None:
        x = ms / floor_ms if floor_ms else None
        out.append(row(name, ms, "ms", part, x_floor=x, tolerance=PAGED_WALL_TOLERANCE, note=note))
        if split:
            kx = split["kernel_ms"] / floor_ms if floor_ms else None
            out.append(row(f"{name}, kernels", split["kernel_ms"], "ms", part, x_floor=kx,
                           tolerance=PAGED_KERNELS_TOLERANCE,
                           note=f"device time of its {split['kernels']} kernels (attention {split['attention_ms']:.3f}, "
                                f"matmul {split['matmul_ms']:.3f}, other {split['other_ms']:.3f} ms); wall {ms:.3f} ms"))

    name = f"{model} paged prompt chunk {chunk_len} after {context}"
    graph = {p["tokens"]: p["ms"] for p in report["prefill_graph"]}
    chunk = next((c for c in report["chunks"] if c["tokens"] == chunk_len and c["context"] == context), None)
    if chunk is None:
        out.append(row(name, None, "ms", part, status="not run", note="not reached"))
    else:
        timed(name, chunk["ms"], chunk["split"],
              f"prefill graph on {chunk_len} tokens {graph.get(chunk_len, float('nan')):.3f} ms")
    t = report.get("together")
    if t:
        out.append(row(f"{model} paged {t['rows']} chunks of {t['tokens']} after {t['context']}, one call",
                       t["one_call_ms"], "ms", part, tolerance=PAGED_WALL_TOLERANCE,
                       note=f"one call each: {t['one_call_each_ms']:.3f} ms"))
    m = report.get("mixed")
    if m:  # the step a server runs where both are due: one call of the mixed step, against the two calls
        timed(f"{model} paged mixed step, {m['rows']} decode rows and a {m['tokens']}-token chunk", m["one_call_ms"],
              m.get("split"), f"two calls (chunk, then decode): {m['two_calls_ms']:.3f} ms"
              + (f"; with the host busy (a thread encoding JSON): {m['one_call_loaded_ms']:.3f} ms in one call, "
                 f"{m['two_calls_loaded_ms']:.3f} ms in two" if "one_call_loaded_ms" in m else ""))
    for n in rows:
        d = next((d for d in report["decode"] if str(d["rows"]) == n), None)
        rname = f"{model} paged decode step {n} rows"
        if d is None:
            out.append(row(rname, None, "ms", part, status="not run", note="not reached"))
            continue
        timed(rname, d["ms"], d.get("split"), f"{d['context']} tokens a row; floor {d['floor_ms']:.3f} ms; "
              f"{'a captured bucket' if d['captured'] else 'called directly'}", d["floor_ms"])
    return out


def smollm2_step(g: Gate) -> None:
    name = "SmolLM2-135M bf16 greedy = transformers"
    part = g.part
    given = g.args.smollm2
    if not given or not Path(given).exists():
        g.add(row(name, None, "prompts", part, status="not run", hard=True,
                  note=f"no SmolLM2 folder or pieces ({'--smollm2 not given' if not given else given + ' is absent'}); "
                       "docs/gate.md says how to carry them"))
        return
    import smollm2

    source = Path(given)
    model = source if (source / "model.safetensors").is_file() else smollm2.unpack(source, g.work / "smollm2-hf")
    out = g.work / "greedy.json"
    rc, text = g.child("smollm2", [sys.executable, "benchmarks/greedy_match.py", "--model", str(model), "--engines",
                                   str(g.store), "--work", str(g.work / "smollm2-recipes"), "--out", str(out)]
                       + (["--new-tokens", "8"] if g.args.tiny else []), reserve=g.args.reserve)
    try:
        result = json.loads(out.read_text())
    except (OSError, ValueError):
        g.add(row(name, None, "prompts", part, hard=True, status="error" if rc is not None else "not run",
                  note=text.strip()[-300:]))
        return
    hit = result["cache_hit"]
    g.add(row("build SmolLM2-135M bf16", None if hit else result["build_s"], "s", part, tolerance=0.25,
              context="seeded" if g.args.seed else "cold", status="not run" if hit else "ok",
              note="a cache hit: built by an earlier run" if hit else "tactics level none"))
    n = len(result["prompts"])
    g.add(row(name, result["equal"], "prompts", part, target=f"all {n} equal", met=result["equal"] == n, hard=True,
              note="; ".join(f"{p['matched']}/{p['compared']} ({p['stop'][:60]})" for p in result["prompts"])))


def gptq_step(g: Gate) -> None:
    """benchmarks/probes/gptq_probe.py at the 8B's shapes, fp8 and int4 (CUDA only)."""
    out = g.work / "gptq"
    shutil.rmtree(out, ignore_errors=True)
    rc, text = g.child("gptq", [sys.executable, "benchmarks/probes/gptq_probe.py", "--models", "8b", "--formats",
                                "fp8", "int4", "--out", str(out)], reserve=g.args.reserve)
    try:
        report = json.loads((out / "gptq_probe.json").read_text())
    except (OSError, ValueError):
        g.add(row("GPTQ's ways store what the eager loop does", None, "tests", g.part, hard=True,
                  status="error" if rc is not None else "not run", note=text.strip()[-300:]))
        return
    for r in gptq_rows(report["rows"], g.part):
        g.add(r)


def gptq_rows(probe: list[dict[str, Any]], part: int) -> list[dict[str, Any]]:
    """The gate's rows of gptq_probe.json: per format, the loops over a model's every layer by its fastest way,
    the eager loop's seconds beside; and one hard row, every way storing the eager loop's tensors."""
    out: list[dict[str, Any]] = []
    for (model, fmt) in dict.fromkeys((r["model"], r["format"]) for r in probe):
        mine = [r for r in probe if (r["model"], r["format"]) == (model, fmt)]
        ways = [w for w in ("kernel", "graphs", "eager") if all(w in r for r in mine)]
        total = {w: sum(r[w]["s"] * r["layers"] for r in mine) for w in ways}
        out.append(row(f"GPTQ {fmt} loops, every {model.upper()} layer ({ways[0]})", total[ways[0]], "s", part,
                       tolerance=0.25, note=", ".join(f"{w} {t:.1f} s" for w, t in total.items())))
    same = [r for r in probe if all(r["same_as_eager"].values())]
    out.append(row("GPTQ's ways store what the eager loop does", len(same), "tests", part,
                   target=f"all {len(probe)} shapes", met=len(same) == len(probe), hard=True,
                   note="; ".join(f"{r['model']} {r['shape']} {r['format']}: {r['same_as_eager']}" for r in probe
                                  if r not in same)[:300]))
    return out


# label -> pytest's arguments: each a correctness row, its value the tests passed, met where none failed
GPU_TESTS = {"quantized op": ["tests/test_quant_kernels.py"],
             "GPTQ block loops": ["tests/test_gptq_kernel.py"],
             "paged decode and mixed steps": ["tests/test_gpu.py", "-k", "paged_decode_through_the_kernel"]}


def gpu_tests_step(g: Gate) -> None:
    import xml.etree.ElementTree as ET

    for label, args in GPU_TESTS.items():
        slug = label.replace(" ", "-")
        report = g.work / f"gpu-tests-{slug}.xml"
        report.unlink(missing_ok=True)
        rc, text = g.child(f"gpu-tests-{slug}", [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p",
                                                 "no:cacheprovider", f"--junitxml={report}", *args],
                           reserve=g.args.reserve)
        name = f"GPU tests: {label}"
        try:
            suite = ET.parse(report).getroot()
            suite = suite if suite.tag == "testsuite" else suite[0]
            counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        except (OSError, ET.ParseError, IndexError):
            g.add(row(name, None, "tests", g.part, hard=True, status="error" if rc is not None else "not run",
                      note=text.strip()[-300:]))
            continue
        passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        failed = counts["failures"] + counts["errors"]
        g.add(row(name, passed, "tests", g.part, target="none failed", met=failed == 0 and passed > 0, hard=True,
                  note=f"{failed} failed, {counts['skipped']} skipped; "
                       + (text.strip().splitlines() or [""])[-1][-200:]))


RUNNERS: dict[str, Callable[[Gate], None]] = {
    "build_bf16": lambda g: build_step(g, "bf16"), "profile": profile_step, "bench_bf16": bench_bf16_step,
    "serve": serve_step, "build_fp8": lambda g: build_step(g, "fp8"), "build_int4": lambda g: build_step(g, "int4"),
    "bench_quant": bench_quant_step, "bench_int4": lambda g: bench_quant_step(g, ("int4",)),
    "profile_int4": lambda g: profile_step(g, "int4", "1,8"),
    "build_int4_head": lambda g: build_step(g, "int4_head"),
    "bench_int4_head": lambda g: bench_quant_step(g, ("int4", "int4_head")),
    "bench_quant_head": lambda g: bench_quant_step(g, ("fp8", "int4", "int4_head")),
    "bench_head": lambda g: bench_quant_step(g, ("int4_head",)),
    "profile_int4_head": lambda g: profile_step(g, "int4_head", "1,8"),
    "serve_paged": serve_paged_step, "serve_8b": serve_8b_step, "serve_captured": serve_captured_step,
    "paged_probe": paged_probe_step,
    "smollm2": smollm2_step,
    "gpu_tests": gpu_tests_step, "gptq": lambda g: gptq_step(g),
}
# One call (--part all): part 2's short steps before part 1's torch.compile, whose tail is the longest
ALL_ORDER = ("build_bf16", "profile", "serve", "build_fp8", "build_int4", "bench_quant", "bench_int4", "profile_int4",
             "build_int4_head", "bench_int4_head", "bench_quant_head", "bench_head", "profile_int4_head",
             "serve_paged", "serve_captured", "paged_probe", "serve_8b", "gpu_tests", "gptq", "smollm2", "bench_bf16")


# -- seeds ----------------------------------------------------------------------------------------------------------------
def unpack_seeds(g: Gate, folder: Path) -> None:
    """device_session.sh's seeds: tactics.tar.gz* into the store, peer-cache.tar.gz.part-* into the peer caches."""
    for stem, into in (("tactics.tar.gz", g.store), ("peer-cache.tar.gz", g.peer_cache)):
        parts = sorted(folder.glob(f"{stem}*"))
        if not parts:
            continue
        into.mkdir(parents=True, exist_ok=True)
        data = b"".join(p.read_bytes() for p in parts)
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            tar.extractall(into, filter="data")
        g.log(f"seeded {into} from {len(parts)} part(s) of {folder}/{stem} ({len(data) >> 20} MiB)")


def save_seeds(g: Gate) -> None:
    """The store's compiled graphs and decode-matmul timings, and Inductor's cache of the torch.compile peer, as
    parts of at most 15 MiB under --out (device_session.sh's names, so either reads the other's seeds)."""
    graphs = [p for p in sorted((g.store / "tactics" / "torch").glob("*/*")) if p.name in ("graphs", "decode_matmul")]
    for stem, root, items in (("tactics.tar.gz", g.store, graphs),
                              ("peer-cache.tar.gz", g.peer_cache, [g.peer_cache / "inductor"])):
        items = [p for p in items if p.exists()]
        if not items:
            continue
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            for p in items:
                tar.add(p, arcname=str(p.relative_to(root)))
        data = buf.getvalue()
        for i in range(0, len(data), SEED_PART):
            (g.out / f"{stem}.part-a{chr(ord('a') + i // SEED_PART)}").write_bytes(data[i:i + SEED_PART])
        g.log(f"saved {stem}: {len(data) >> 20} MiB in {-(-len(data) // SEED_PART)} part(s)")


def details(g: Gate) -> None:
    """The children's reports and logs in one file: at most 8 files come back from a device call."""
    with tarfile.open(g.out / "details.tar.gz", "w:gz") as tar:
        for p in sorted(g.work.rglob("*")):
            if p.is_file() and p.suffix in (".json", ".log", ".txt", ".png") and "peer-cache" not in p.parts \
                    and "smollm2-hf" not in p.parts and p.stat().st_size < 4 << 20:
                tar.add(p, arcname=str(p.relative_to(g.work)))


# -- main -------------------------------------------------------------------------------------------------------------------
def device_name(cpu: bool) -> str:
    if cpu:
        return "cpu"
    proc = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0) "
                           "if torch.cuda.is_available() else 'cpu')"], capture_output=True, text=True)
    return proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 and proc.stdout.strip() else "unknown"


def commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=REPO).stdout.strip()
        return sha + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def steps_to_run(part: str, only: str | None) -> list[str]:
    """The steps of `part` in their order, or with `only` (a comma list of STEPS' keys) those alone, in the
    order every step runs: a rerun of the rows one change can move (a quantized kernel: the quantized builds and
    rows, with the bf16 engine they are measured against), on one call."""
    if only:
        wanted = [k.strip() for k in only.split(",") if k.strip()]
        unknown = [k for k in wanted if k not in STEPS]
        if unknown:
            raise SystemExit(f"gate.py: --only: unknown step(s) {', '.join(unknown)} (known: {', '.join(STEPS)})")
        return [k for k in ALL_ORDER if k in wanted]
    return [k for k in ALL_ORDER if STEPS[k].part] if part == "all" else [k for k, s in STEPS.items()
                                                                            if str(s.part) == part]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("1", "2", "3", "all"), default="all",
                    help="1: the 1B bf16 rows with torch.compile and the profile; 2: serve, fp8/int4_wo; 3: paged "
                         "serving, SmolLM2 (2 and 3 on the machine part 1 left warm: its store in --engines); "
                         "all: every step in one call")
    ap.add_argument("--plan", action="store_true", help="print the steps and their estimated seconds, run nothing")
    ap.add_argument("--only", default=None, help=f"a comma list of steps to run alone, whatever --part says "
                                                 f"({', '.join(STEPS)})")
    ap.add_argument("--budget", type=float, default=560.0, help="seconds this run may take in all (default 560)")
    ap.add_argument("--reserve", type=float, default=15.0, help="seconds kept back from each step for the report")
    ap.add_argument("--engines", default="/tmp/gate-engines", help="the store (part 2 reuses part 1's)")
    ap.add_argument("--work", default="/tmp/gate-work", help="the children's reports and logs")
    ap.add_argument("--out", default=None, help="default benchmarks/results/<date>-<device>-gate")
    ap.add_argument("--seed", action="append", type=Path, default=[],
                    help="a folder of tactics.tar.gz* / peer-cache.tar.gz.part-* seeds (repeatable)")
    ap.add_argument("--save-seeds", action="store_true", help="write the caches back as parts of <= 15 MiB under --out")
    ap.add_argument("--smollm2", default=None,
                    help="SmolLM2's Hugging Face folder, or the pieces `benchmarks/smollm2.py carry` wrote, gathered")
    ap.add_argument("--baseline", type=Path, default=None, help="default benchmarks/baselines/<card>.json")
    ap.add_argument("--write-baseline", default=None, metavar="WHY",
                    help="write the baseline from this run's rows (the other rows kept); WHY is recorded in it")
    ap.add_argument("--commit", default=None, help="the commit measured (default: git, where the tree has .git)")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--serve-s", type=float, default=20.0)
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="the plumbing on a CPU: tiny-llama, quick shapes, no torch.compile, serve for a few seconds")
    ap.add_argument("--smoke", action="store_true",
                    help="the plumbing on this machine's device (a GPU where there is one): tiny-llama and its "
                         "quantized copies, quick shapes, serve for a few seconds; rows named 'tiny'")
    args = ap.parse_args(argv)
    args.tiny = args.smoke or args.cpu_smoke
    if args.tiny:
        args.streams, args.serve_s = min(args.streams, 4), min(args.serve_s, 4.0)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.plan:
        print(plan_text(bool(args.seed)))
        return 0
    date = time.strftime("%Y-%m-%d")
    device = device_name(args.cpu_smoke)
    card = gate_report.card(device)
    args.out = args.out or os.environ.get("OUT") or str(
        HERE / "results" / f"{date}-{card or device.split()[-1].lower()}-gate")
    g = Gate(args)
    # A device call's limit ends this process with SIGTERM: stop where it is, keep the rows, print the table
    signal.signal(signal.SIGTERM, _stop)
    base_path = args.baseline or (HERE / "baselines" / f"{card}.json" if card else None)
    g.baseline = gate_report.load_baseline(base_path) if base_path else None
    g.report = {"device": device, "card": card, "commit": args.commit or commit(), "date": date,
                "time": time.strftime("%H:%M:%S"), "part": args.part, "command": " ".join(sys.argv),
                "smoke": args.tiny, "budget_s": args.budget, "seeds": [str(s) for s in args.seed],
                "baseline": str(base_path) if g.baseline else None, "host_s": gate_report.host_speed(), "rows": []}
    # a later part on the machine the part before it left warm: its rows come along, so the last part's
    # gate.json holds the whole gate
    earlier = g.work / f"gate-part{int(args.part) - 1}.json" if args.part in ("2", "3") else None
    if earlier is not None and earlier.is_file():
        prior = json.loads(earlier.read_text())
        if prior.get("commit") == g.report["commit"]:
            g.report["rows"] = prior["rows"]
            g.log(f"part 1's {len(prior['rows'])} rows taken from {earlier}")
    g.save()
    g.log(f"device {device}, commit {g.report['commit']}, baseline {base_path if g.baseline else 'none'}, "
          f"budget {args.budget:.0f} s, out {g.out}, host loop {g.report['host_s']:.3f} s")
    for seed in args.seed:
        unpack_seeds(g, seed)
    order = steps_to_run(args.part, args.only)
    try:
        for key in order:
            if g.left() < args.reserve + 15:
                g.log(f"{STEPS[key].name}: not run, {g.left():.0f} s left")
                g.report.setdefault("not_run", []).append(STEPS[key].name)
                g.save()
                continue
            g.part, g.host_bound = STEPS[key].part, key in HOST_BOUND
            g.log(f"{STEPS[key].name} ({g.left():.0f} s left; estimated {STEPS[key].seeded_s if args.seed else STEPS[key].cold_s:.0f} s)")
            try:
                RUNNERS[key](g)
            except Exception as exc:  # noqa: BLE001 - one broken step must not cost the other rows
                g.log(f"{STEPS[key].name}: {type(exc).__name__}: {exc}")
                g.report.setdefault("step_errors", {})[key] = f"{type(exc).__name__}: {str(exc)[:500]}"
                g.save()
    except Stopped:
        g.report["stopped"] = "SIGTERM: the rows are what was measured before it"
        g.save()
    if args.save_seeds:
        save_seeds(g)
    details(g)
    if args.write_baseline and not base_path:
        g.log(f"no baseline written: {device} is neither an H100 nor an H200 (--baseline names a file)")
    elif args.write_baseline and base_path:
        base_path.parent.mkdir(parents=True, exist_ok=True)
        base_path.write_text(json.dumps(gate_report.baseline_from(g.report, g.baseline, args.write_baseline),
                                        indent=1) + "\n")
        g.log(f"baseline written: {base_path}")
    g.save()
    g.log(gate_report.plot(g.report, g.out / "gate.png"))
    text = gate_report.table(g.report)
    print(text, flush=True)
    g.log_file.write(text + "\n")
    g.log_file.close()
    if "stopped" in g.report:
        return 143  # the status SIGTERM would have given: a gate cut short has not passed
    return 1 if gate_report.failed(g.report["rows"]) or g.report.get("step_errors") else 0


class Stopped(BaseException):
    """SIGTERM, raised where the gate is. Not an Exception: a step's own handler must not swallow it."""


def _stop(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second TERM ends the process at once
    raise Stopped


if __name__ == "__main__":
    sys.exit(main())
