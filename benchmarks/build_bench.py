"""Build time on the CPU: cold builds of tiny-llama and SmolLM2-135M fp32, and a new checkpoint of an
architecture already built.

Each build is `trtbuild build --json` in a new process against a store of its own (cold: no engine, no
tactic cache, no compiled graph), timed from outside (wall) and by the operating system's accounting of the
process and its children (CPU seconds: on a shared host the wall figure moves with the neighbours' load,
the CPU figure much less). The new-checkpoint row builds the same architecture again in the same store with
other weights (SmolLM2's checkpoint with every weight perturbed, or tiny-llama with another seed): every
compiled graph comes from the tactic cache, so what is left is export, copying graphs and writing weights.

    python benchmarks/build_bench.py [--only tiny|smollm2] [--out benchmarks/results/<date>-cpu-build]

Prints a table of each build's phases (start-up, weights, export, compile and its Inductor / C++ split, the
compile workers' seconds, how many graphs were compiled) and writes build.json with the same and every graph's
seconds; the host's load average is recorded beside each row.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_SHAPES = {"max_batch_size": 4, "max_input_len": 64, "max_seq_len": 512, "batch_buckets": [4]}


def build(recipe: Path, store: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """One `trtbuild build --json` in a new process: its report, wall and CPU seconds, the load before it."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load = os.getloadavg()[0]
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "trtbuild", "build", str(recipe), "--engines", str(store), "--json"],
                          capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"build of {recipe} failed:\n{proc.stderr[-3000:]}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    entry = Path(report["engine"]["path"])
    graphs = json.loads((entry / "engine.json").read_text())["graphs"]
    return {"wall_s": wall, "cpu_s": cpu, "load_1min": load, "startup_s": report["startup_s"],
            "build_s": report["build_s"], "phases": report["phases"],
            "graphs_compile_s": {n: g.get("compile_s") for n, g in graphs.items()},
            "graphs_compile_parts_s": {n: [g.get("compile_inductor_s"), g.get("compile_cxx_s")] for n, g in graphs.items()},
            "compiled": len({g["digest"] for n, g in graphs.items() if not g.get("reused")}),
            "reused": [n for n, g in graphs.items() if g.get("reused")],
            "workers": {n: g["worker"].get("total_s") for n, g in graphs.items() if "worker" in g}}


def write_recipe(folder: Path, name: str, model: dict[str, Any], shapes: dict[str, Any]) -> Path:
    import yaml

    doc = {"name": name, "model": model, "backend": "torch", "precision": "fp32", "shapes": shapes,
           "tactics": {"level": "default"}}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def perturbed_copy(source: Path, dest: Path) -> Path:
    """SmolLM2's folder with every floating-point weight nudged: the same architecture, new weights."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    dest.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dest / f.name)
    state = load_file(str(source / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    state = {k: v + 1e-3 * torch.randn(v.shape, generator=gen, dtype=v.dtype) if v.is_floating_point() else v
             for k, v in state.items()}
    save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def tiny_rows(work: Path) -> list[dict[str, Any]]:
    import yaml

    doc = yaml.safe_load((ROOT / "recipes" / "tiny-llama.yaml").read_text())
    store = work / "tiny-store"
    cold = build(ROOT / "recipes" / "tiny-llama.yaml", store)
    other = write_recipe(work, "tiny-llama-seed1", doc["model"] | {"seed": 1}, doc["shapes"])
    again = build(other, store)
    return [{"build": "tiny-llama, cold", **cold}, {"build": "tiny-llama, new checkpoint (seed 1)", **again}]


def smollm2_rows(work: Path) -> list[dict[str, Any]]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import smollm2

    folder = smollm2.folder()
    store = work / "smollm2-store"
    cold = build(write_recipe(work, "smollm2-135m-fp32", {"source": str(folder)}, SMOLLM2_SHAPES), store)
    t = time.perf_counter()
    other = perturbed_copy(folder, work / "smollm2-perturbed")
    written = time.perf_counter() - t
    again = build(write_recipe(work, "smollm2-135m-fp32-perturbed", {"source": str(other)}, SMOLLM2_SHAPES), store)
    again["note"] = f"the perturbed checkpoint was written in {written:.1f} s before it (not in the row)"
    return [{"build": "SmolLM2-135M fp32, cold", **cold}, {"build": "SmolLM2-135M fp32, new checkpoint", **again}]


def commit() -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return proc.stdout.strip() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["tiny", "smollm2"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="build-bench-") as tmp:
        work = Path(tmp)
        if args.only in (None, "tiny"):
            rows += tiny_rows(work)
        if args.only in (None, "smollm2"):
            rows += smollm2_rows(work)
    # compile s is wall time in the build process; Inductor / C++ are the seconds of the graphs it compiled itself
    # or in its forks (a CPU build: their sum can pass compile s); a worker process's graph is timed in its own
    # report (the `worker s` column, its whole life; for a fork, from the fork on)
    print(f"{'build':40s} {'wall s':>7s} {'CPU s':>6s} {'load':>5s} {'start s':>7s} {'weights s':>9s} "
          f"{'export s':>8s} {'compile s':>9s} {'Inductor':>8s} {'C++':>6s} {'worker s':>8s} {'graphs':>6s}  reused")
    for r in rows:
        p = r["phases"]
        # the synthetic checkpoint's writing included: the tiny rows' model is synthetic (a real one is read instead)
        weights = p.get("draw_synthetic_weights_s", 0) + p.get("load_weights_s", 0) + p.get("write_weights_s", 0)
        worker = max(r["workers"].values(), default=0.0)
        print(f"{r['build']:40s} {r['wall_s']:7.1f} {r['cpu_s']:6.1f} {r['load_1min']:5.1f} {r['startup_s']:7.1f} "
              f"{weights:9.1f} {p.get('export_s', 0):8.1f} {p.get('compile_s', 0):9.1f} "
              f"{p.get('compile_inductor_s', 0):8.1f} {p.get('compile_cxx_s', 0):6.1f} {worker:8.1f} "
              f"{r['compiled']:6d}  {','.join(r['reused']) or '-'}")
    result = {"date": datetime.date.today().isoformat(), "commit": commit(), "cores": os.cpu_count(),
              "command": "python " + " ".join(sys.argv), "rows": rows}
    out = args.out or ROOT / "benchmarks" / "results" / f"{result['date']}-cpu-build"
    out.mkdir(parents=True, exist_ok=True)
    (out / "build.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out / 'build.json'}")


if __name__ == "__main__":
    main()
