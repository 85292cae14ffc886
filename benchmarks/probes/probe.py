"""A/B of Inductor options for one compiled graph: which kernels make a decode step or a prefill fastest.

Exports the recipe's decode step at one batch size, or its prefill (the backend's own exports),
compiles it once per option set with AOTInductor, and runs each through trtbuild's own runtime
(user-managed constants; decode through one CUDA graph per cache window), timing it and listing its
kernels. For prefill, `--example-lens` also varies the prompt length the graph is exported (and so
tuned) at: the backend exports at 2 tokens, and Inductor tunes kernels at the example sizes. A probe
for choosing the backend's defaults, not a benchmark of the engine (bench.py is that).

    python benchmarks/probes/probe.py recipes/llama-3.2-1b.yaml --graph decode --batch 1 --options plain,autotune
    python benchmarks/probes/probe.py recipes/llama-3.1-8b.yaml --graph prefill --options plain,autotune --example-lens 2,2048
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # peers.py, beside bench.py
import trtbuild  # noqa: E402,F401  - before torch: one libstdc++ for the compiled graphs

import torch  # noqa: E402

import peers  # noqa: E402
from trtbuild.backends.torch import export, graph_cache, inductor  # noqa: E402
from trtbuild.backends.torch.decode_graphs import DecodeGraphs  # noqa: E402
from trtbuild.backends.torch.graph_runners import Package  # noqa: E402
from trtbuild.models.source import resolve  # noqa: E402
from trtbuild.recipe import load_recipe  # noqa: E402
from trtbuild.store.local import Store  # noqa: E402
from trtbuild.timing import StepClock, sync  # noqa: E402

# Inductor option sets on top of the backend's base options (no weights in the .so, kept constants).
OPTIONS: dict[str, dict[str, Any]] = {
    "plain": {},  # Inductor's defaults: matmuls through cuBLAS (tactics `default`)
    "cd": {"coordinate_descent_tuning": True},  # batch-1 matmuls become tuned Triton GEMV reductions
    "autotune": {"max_autotune": True},  # GEMM templates benchmarked against cuBLAS (tactics `max`)
    "autotune_cd": {"max_autotune": True, "coordinate_descent_tuning": True},
    # independent small kernels (rope of q, rope + cache write of k, cache write of v) horizontally
    # fused into one launch each: a decode step is ~15 launches per layer, many of them ~1 us
    "combo": {"combo_kernels": True},
    "autotune_combo": {"max_autotune": True, "combo_kernels": True},
    # every Triton GEMM config Inductor knows instead of its short list (skinny decode GEMMs are far
    # from the shapes the short list was chosen for); compiles for many minutes on a large model
    "autotune_exhaustive": {"max_autotune": True, "max_autotune_gemm_search_space": "EXHAUSTIVE"},
}


# A decode step profiled kernel by kernel: what each option set's graph spends its time on.
def profile_steps(decoder: Any, batch: int, prompt_len: int, steps: int, device: str) -> dict[str, Any]:
    """Time `steps` decode steps from position prompt_len, then profile as many again."""
    first = torch.ones(decoder.tok.shape[0], dtype=torch.long, device=device)
    decoder.prepare(prompt_len, prompt_len + steps)  # captures the graphs these steps replay
    decoder.start(first, prompt_len)
    sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        decoder.step()
    sync(device)
    wall = (time.perf_counter() - t) / steps

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    decoder.start(first, prompt_len)
    sync(device)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            decoder.step()
        sync(device)
    kernels = kernels_of(prof, steps)
    return {"batch": batch, "bucket": decoder.tok.shape[0], "prompt_len": prompt_len, "steps": steps,
            "window": decoder.window_for(prompt_len),  # at the first step
            "wall_us_per_step": wall * 1e6,
            "kernel_us_per_step": sum(k["us_per_step"] for k in kernels),
            "launches_per_step": sum(k["per_step"] for k in kernels), "kernels": kernels}


def kernels_of(prof: Any, calls: int) -> list[dict[str, Any]]:
    """Device kernels a profile saw, per call of what was profiled (`calls` of them), slowest first."""
    kernels = []
    for e in prof.key_averages():
        device_us = getattr(e, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(e, "self_cuda_time_total", 0)
        if device_us and "CUDA" in str(e.device_type):
            kernels.append({"name": e.key, "per_step": e.count / calls, "us_per_step": device_us / calls})
    return sorted(kernels, key=lambda k: -k["us_per_step"])


def show(r: dict[str, Any], top: int) -> str:
    lines = [f"== batch {r['batch']} (bucket {r['bucket']}), after a {r['prompt_len']}-token prompt, window "
             f"{r['window']} slots: wall {r['wall_us_per_step']:.1f} us/step, kernels {r['kernel_us_per_step']:.1f} "
             f"us/step in {r['launches_per_step']:.0f} launches (gaps {r['wall_us_per_step'] - r['kernel_us_per_step']:.1f} us)"]
    lines.append(f"  {'us/step':>9} {'share':>6} {'per step':>8}  kernel")
    for k in r["kernels"][:top]:
        share = k["us_per_step"] / max(r["wall_us_per_step"], 1e-9)
        lines.append(f"  {k['us_per_step']:9.2f} {share:6.1%} {k['per_step']:8.1f}  {k['name'][:110]}")
    return "\n".join(lines)


def compile_graph(program: Any, options: str, work: Path, device: str, consts: dict[str, Any]) -> tuple[Any, float]:
    """AOTInductor-compile `program` under one option set; the loaded graph and the compile time."""
    t = time.perf_counter()
    work.mkdir(parents=True, exist_ok=True)
    package = work / f"{options}.pt2"
    base = inductor.inductor_configs("default", device)  # the backend's base options
    torch._inductor.aoti_compile_and_package(program, package_path=str(package), inductor_configs=base | OPTIONS[options])
    so = work / options / graph_cache.extract_model(package, work / options).split("/", 1)[1]
    graph = Package(so, device)
    graph.load_constants(consts)
    return graph, time.perf_counter() - t


def time_prefill(graph: Any, length: int, reps: int, vocab: int, device: str) -> dict[str, Any]:
    """Median time of `reps` batch-1 prompts of `length` tokens (after two warm-ups), and the kernels
    of one more, profiled."""
    tokens = torch.tensor([[(7 * i) % (vocab - 1) + 1 for i in range(length)]], device=device)
    positions = torch.arange(length, device=device)
    slots = torch.zeros(1, dtype=torch.long, device=device)  # the prompt's cache row
    for _ in range(2):
        graph(tokens, positions, slots)
    clock = StepClock(device)
    clock.mark()
    for _ in range(reps):
        graph(tokens, positions, slots)
        clock.mark()
    samples = clock.intervals()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        graph(tokens, positions, slots)
        torch.cuda.synchronize() if device.startswith("cuda") else None
    return {"length": length, "p50_ms": statistics.median(samples) * 1e3, "n": len(samples),
            "kernels": kernels_of(prof, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe")
    ap.add_argument("--graph", choices=("decode", "prefill"), default="decode")
    ap.add_argument("--options", default="plain,autotune", help=f"comma list of {', '.join(OPTIONS)}")
    ap.add_argument("--batch", type=int, default=1, help="decode: the batch size (bucket) of the graph")
    ap.add_argument("--prompt-len", type=int, default=128, help="decode: position of the first timed step")
    ap.add_argument("--steps", type=int, default=128, help="decode: steps timed, then as many profiled")
    ap.add_argument("--example-lens", default="2", help="prefill: prompt lengths to export (and tune) at")
    ap.add_argument("--lengths", default="128,1024,2048", help="prefill: prompt lengths timed (batch 1)")
    ap.add_argument("--reps", type=int, default=10, help="prefill: timed prompts per length")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default="probe.json")
    args = ap.parse_args()
    unknown = [o for o in args.options.split(",") if o not in OPTIONS]
    if unknown:
        ap.error(f"--options: unknown {', '.join(unknown)} (known: {', '.join(OPTIONS)})")
    recipe = load_recipe(args.recipe)
    shapes = recipe.shapes
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, inductor.DTYPE_NAMES[recipe.precision])
    work = Path(tempfile.mkdtemp(prefix="probe-"))
    folder = resolve(recipe.model, Store(str(work / "store")).root).materialize()
    model = peers.load_transformer(folder, dtype, device, shapes.max_batch_size, shapes.max_seq_len)
    consts = {f"model.{n}": t for n, t in [*model.named_parameters(), *model.named_buffers()]}
    results: dict[str, Any] = {"recipe": args.recipe, "graph": args.graph, "device": device, "runs": {}}

    def save() -> None:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")

    def decode_run(name: str, program: Any) -> dict[str, Any]:
        graph, compile_s = compile_graph(program, name, work, device, consts)
        decoder = DecodeGraphs(graph, args.batch, shapes.max_seq_len, device)
        r = profile_steps(decoder, args.batch, args.prompt_len, args.steps, device)
        print(f"[probe] decode b{args.batch} {name}: compile {compile_s:.1f} s\n{show(r, args.top)}", flush=True)
        return r | {"compile_s": compile_s}

    def prefill_run(name: str, program: Any, example_len: int) -> dict[str, Any]:
        graph, compile_s = compile_graph(program, name, work / str(example_len), device, consts)
        runs = [time_prefill(graph, t, args.reps, model.cfg.vocab_size, device) for t in lengths]
        print(f"[probe] prefill {name}@{example_len}: compile {compile_s:.1f} s; "
              + ", ".join(f"{r['length']} tokens {r['p50_ms']:.3f} ms" for r in runs), flush=True)
        for k in runs[-1]["kernels"][:args.top]:
            print(f"  {k['us_per_step']:10.1f} us {k['per_step']:6.0f}x  {k['name'][:110]}")
        return {"example_len": example_len, "compile_s": compile_s, "lengths": runs}

    def attempt(label: str, name: str, run: Any) -> None:
        """One option set; a failure (an option this torch's AOTInductor cannot compile) is recorded
        and the probe goes on with the next."""
        try:
            results["runs"][label] = {"inductor_options": OPTIONS[name]} | run()
        except Exception as exc:  # noqa: BLE001 - the A/B of the other option sets still counts
            results["runs"][label] = {"inductor_options": OPTIONS[name], "error": f"{type(exc).__name__}: {exc}"[:800]}
            print(f"[probe] {label}: failed: {results['runs'][label]['error']}", flush=True)
        save()
        if device == "cuda":
            torch.cuda.empty_cache()

    lengths = [min(int(x), shapes.max_input_len) for x in args.lengths.split(",")]
    try:
        if args.graph == "decode":
            program = export.export_decode(model, args.batch, shapes.max_seq_len, device)
            for name in args.options.split(","):
                attempt(name, name, lambda name=name, program=program: decode_run(name, program))
            return
        for example_len in (int(x) for x in args.example_lens.split(",")):
            program = export.export_prefill(model, shapes.max_batch_size, shapes.max_input_len, device, example_len)
            for name in args.options.split(","):
                attempt(f"{name}@{example_len}", name,
                        lambda name=name, program=program, n=example_len: prefill_run(name, program, n))
    finally:
        save()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
