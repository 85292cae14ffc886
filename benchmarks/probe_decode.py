"""A/B of Inductor options for one decode graph: which kernels make a decode step fastest here.

Exports the recipe's decode step at one batch size (the backend's own export), compiles it once per
option set with AOTInductor, and runs each through trtbuild's own runtime (user-managed constants,
one CUDA graph per cache window), timing decode steps after a prompt and profiling their kernels.
A probe for choosing the backend's defaults, not a benchmark of the engine (bench.py is that).

    python benchmarks/probe_decode.py recipes/llama-3.2-1b.yaml --batch 1 --options cd,plain --out probe.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import trtbuild  # noqa: E402,F401  - before torch: one libstdc++ for the compiled graphs

import torch  # noqa: E402

import peers  # noqa: E402
from profile_decode import profile_steps, show  # noqa: E402
from trtbuild.backends import torch_aoti  # noqa: E402
from trtbuild.backends.torch_runtime import _Decoder, _Model  # noqa: E402
from trtbuild.models.source import resolve  # noqa: E402
from trtbuild.recipe import load_recipe  # noqa: E402
from trtbuild.store import Store  # noqa: E402

# Inductor option sets on top of the backend's base options (no weights in the .so, kept constants).
OPTIONS: dict[str, dict[str, Any]] = {
    "plain": {},  # Inductor's defaults: matmuls through cuBLAS
    "cd": {"coordinate_descent_tuning": True},  # batch-1 matmuls become tuned Triton GEMV reductions
    "autotune": {"max_autotune": True},  # GEMM templates benchmarked against cuBLAS
    "autotune_cd": {"max_autotune": True, "coordinate_descent_tuning": True},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--options", default="cd,plain", help=f"comma list of {', '.join(OPTIONS)}")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--out", default="probe_decode.json")
    args = ap.parse_args()
    recipe = load_recipe(args.recipe)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, torch_aoti.DTYPE_NAMES[recipe.precision])
    work = Path(tempfile.mkdtemp(prefix="probe-decode-"))
    folder = resolve(recipe.model, Store(str(work / "store")).root).materialize()
    model = peers.load_transformer(folder, dtype, device, recipe.shapes.max_batch_size, recipe.shapes.max_seq_len)
    consts = {f"model.{n}": t for n, t in [*model.named_parameters(), *model.named_buffers()]}
    t = time.perf_counter()
    program = torch_aoti.export_decode(model, args.batch, recipe.shapes.max_seq_len, device)
    export_s = time.perf_counter() - t
    base = torch_aoti.inductor_configs("default", device)  # the backend's base options, Inductor's defaults otherwise
    results: dict[str, Any] = {"recipe": args.recipe, "batch": args.batch, "export_s": export_s, "options": {}}
    for name in args.options.split(","):
        t = time.perf_counter()
        package = work / f"{name}.pt2"
        torch._inductor.aoti_compile_and_package(program, package_path=str(package),
                                                 inductor_configs=base | OPTIONS[name])
        so = work / name / torch_aoti._extract_model(package, work / name).split("/", 1)[1]
        compile_s = time.perf_counter() - t
        graph = _Model(so, device)
        graph.load_constants(consts)
        decoder = _Decoder(graph, args.batch, recipe.shapes.max_seq_len, device)
        r = profile_steps(decoder, args.batch, args.prompt_len, args.steps, device)
        r.update(option=name, inductor_options=OPTIONS[name], compile_s=compile_s)
        results["options"][name] = r
        print(f"[probe] {name}: compile {compile_s:.1f} s", flush=True)
        print(show(r, 25), flush=True)
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
        del decoder, graph
        torch.cuda.empty_cache() if device == "cuda" else None
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
