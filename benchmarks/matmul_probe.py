"""Decode matmuls: trtbuild's Triton kernel against cuBLAS, per weight shape and for a whole step.

A decode step's matmuls read every weight once for 1-8 rows of activations. This probe allocates a
recipe's weight matrices for every layer (distinct tensors, so no call finds its matrix in the 50 MB
L2 cache left by the previous one, as in a real step), and for each weight shape and batch size times,
inside one CUDA graph per candidate (no launch overhead, as in the engine):
  - cuBLAS through `F.linear` (what the compiled graphs call at tactics `default`),
  - every candidate launch configuration of `trtbuild.backends.decode_matmul`,
then the whole step's matmuls in layer order (QKV, output, gate/up, down per layer, then the LM head)
with cuBLAS only, with the Triton kernel's best configuration per shape, and with the faster of the
two per shape. Bandwidth is weight bytes read / time (the copy rate of bench.py counts read + write).
A probe for choosing a default, not a benchmark of the engine (bench.py is that). Needs CUDA + Triton.

    python benchmarks/matmul_probe.py recipes/llama-3.1-8b.yaml recipes/llama-3.2-1b.yaml --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from trtbuild.backends.decode_matmul import MatmulConfig, decode_matmul  # noqa: E402
from trtbuild.models.llama import LlamaConfig  # noqa: E402
from trtbuild.recipe import load_recipe  # noqa: E402

ONE_ROW = [MatmulConfig(n, k, w, s) for n in (4, 8, 16, 32) for k in (256, 512, 1024) for w in (4,) for s in (1, 3)] + [
    MatmulConfig(n, 1024, 8, s) for n in (16, 32) for s in (1, 3)]
DEVICE = "cuda"  # a module constant so the probe's bookkeeping can be dry-run on the CPU (Triton's interpreter)
ROWS = [MatmulConfig(n, k, 4, s) for n in (16, 32, 64) for k in (128, 256, 512) for s in (3, 4)] + [
    MatmulConfig(64, k, 8, s) for k in (256, 512) for s in (3, 4)]


def weight_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, int]]:
    """Per-layer weight shapes [out, in] as the model holds them (QKV and gate/up fused)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"qkv": (q + 2 * kv, cfg.hidden_size), "o": (cfg.hidden_size, q),
            "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size), "down": (cfg.hidden_size, cfg.intermediate_size)}


def graph_time(calls: Callable[[], None], reps: int) -> float:
    """Seconds per replay of one CUDA graph holding `calls`, median of `reps` event-timed replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls()  # compiles / warms outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    times.sort()
    return times[len(times) // 2]


def probe_recipe(path: str, batches: list[int], reps: int) -> dict[str, Any]:
    recipe = load_recipe(path)
    assert recipe.model.config is not None, "the probe takes recipes with an inline (synthetic) config"
    cfg = LlamaConfig.from_hf(recipe.model.config)
    dev, dtype = torch.device(DEVICE), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)

    def weight(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, device=dev, dtype=dtype, generator=gen) * 0.02).contiguous()

    shapes = weight_shapes(cfg)
    weights = {name: [weight(*shape) for _ in range(cfg.num_layers)] for name, shape in shapes.items()}
    weights["head"] = [weight(cfg.vocab_size, cfg.hidden_size)]
    shapes["head"] = (cfg.vocab_size, cfg.hidden_size)
    out: dict[str, Any] = {"recipe": recipe.name, "layers": cfg.num_layers, "shapes": {}, "step": {}}
    for m in batches:
        candidates = ONE_ROW if m == 1 else ROWS
        best: dict[str, MatmulConfig] = {}
        faster: dict[str, str] = {}
        for name, (n, k) in shapes.items():
            ws = weights[name]
            x = torch.randn(m, k, device=dev, dtype=dtype, generator=gen)
            ys = [torch.empty(m, n, device=dev, dtype=dtype) for _ in ws]
            nbytes = sum(w.numel() * w.element_size() for w in ws)
            ref = F.linear(x, ws[0]).float()
            row: dict[str, Any] = {"n": n, "k": k, "calls": len(ws), "bytes_per_call": nbytes // len(ws)}
            def cublas_calls() -> None:
                for w in ws:
                    F.linear(x, w)

            t = graph_time(cublas_calls, reps)
            row["cublas_us"], row["cublas_TBps"] = t / len(ws) * 1e6, nbytes / t / 1e12
            results = {}
            for c in candidates:
                try:
                    y0 = decode_matmul(x, ws[0], c, out=ys[0])
                    err = ((y0.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
                    if err > 2e-2:
                        results[c.name] = {"error": f"wrong result: max relative error {err:.3g}"}
                        continue
                    def triton_calls() -> None:
                        for w, y in zip(ws, ys):
                            decode_matmul(x, w, c, out=y)  # noqa: B023 - timed before the loop moves on

                    t = graph_time(triton_calls, reps)
                    results[c.name] = {"us": t / len(ws) * 1e6, "TBps": nbytes / t / 1e12, "rel_err": err}
                except Exception as e:  # a config that does not compile (shared memory) is a result too
                    results[c.name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
            timed = {k2: v for k2, v in results.items() if "us" in v}
            if timed:
                name_best = min(timed, key=lambda k2: timed[k2]["us"])
                best[name] = next(c for c in candidates if c.name == name_best)
                row["triton_best"] = {"config": name_best, **timed[name_best]}
                faster[name] = "triton" if timed[name_best]["us"] < row["cublas_us"] else "cublas"
            else:
                faster[name] = "cublas"
            row["candidates"] = results
            out["shapes"].setdefault(str(m), {})[name] = row
            tb = row.get("triton_best", {})
            print(f"[probe] {recipe.name} b{m} {name:8s} [{n}x{k}] cublas {row['cublas_us']:8.2f} us "
                  f"{row['cublas_TBps']:.2f} TB/s | triton {tb.get('us', float('nan')):8.2f} us "
                  f"{tb.get('TBps', float('nan')):.2f} TB/s {tb.get('config', '-')}", flush=True)

        def step(choice: dict[str, str]) -> Callable[[], None]:
            xs = {name: torch.randn(m, shapes[name][1], device=dev, dtype=dtype, generator=gen) for name in shapes}
            ys = {name: torch.empty(m, shapes[name][0], device=dev, dtype=dtype) for name in shapes}

            def one(name: str, w: torch.Tensor) -> None:
                if choice[name] == "triton":
                    decode_matmul(xs[name], w, best[name], out=ys[name])
                else:
                    F.linear(xs[name], w)

            def calls() -> None:
                for layer in range(cfg.num_layers):
                    for name in ("qkv", "o", "gate_up", "down"):
                        one(name, weights[name][layer])
                one("head", weights["head"][0])
            return calls

        total = sum(w.numel() * w.element_size() for ws in weights.values() for w in ws)
        plans = {"cublas": {n: "cublas" for n in shapes}, "faster_per_shape": faster}
        if len(best) == len(shapes):
            plans["triton"] = {n: "triton" for n in shapes}
        for plan, choice in plans.items():
            t = graph_time(step(choice), reps)
            out["step"].setdefault(str(m), {})[plan] = {"ms": t * 1e3, "TBps": total / t / 1e12, "choice": choice}
            print(f"[probe] {recipe.name} b{m} whole step's matmuls, {plan:16s} {t * 1e3:7.3f} ms "
                  f"{total / t / 1e12:.2f} TB/s", flush=True)
        out["step"][str(m)]["best_configs"] = {n: c.name for n, c in best.items()}
    del weights
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipes", nargs="+")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", type=Path, default=Path("."))
    a = ap.parse_args()
    t0 = time.perf_counter()
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE,
              "torch": torch.__version__, "command": " ".join(sys.argv), "recipes": []}
    a.out.mkdir(parents=True, exist_ok=True)
    for path in a.recipes:
        result["recipes"].append(probe_recipe(path, [int(b) for b in a.batches.split(",")], a.reps))
        (a.out / "matmul_probe.json").write_text(json.dumps(result, indent=1))
    print(f"[probe] done in {time.perf_counter() - t0:.0f} s; {a.out / 'matmul_probe.json'}")


if __name__ == "__main__":
    main()
