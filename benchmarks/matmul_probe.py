"""Decode matmuls: trtbuild's Triton kernel against cuBLAS, per weight shape and for a whole step.

A decode step's matmuls read every weight once for 1-8 rows of activations. This probe allocates a
recipe's weight matrices for every layer (distinct tensors, so no call finds its matrix in the 50 MB
L2 cache left by the previous one, as in a real step), and for each weight shape and batch size times,
inside one CUDA graph per candidate (no launch overhead, as in the engine):
  - cuBLAS through `F.linear` (what the compiled graphs call at tactics `default`),
  - every candidate launch configuration of `trtbuild.models.decode_matmul` (the build's own
    selection, `decode_matmul.select`),
then the whole step's matmuls in layer order (QKV, output, gate/up, down per layer, then the LM head)
with cuBLAS only and with what the selection chose per shape. Bandwidth is weight bytes read / time (the copy
rate of bench.py counts read + write).
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

from trtbuild.backends.decode_kernels import fastest  # noqa: E402
from trtbuild.models.decode_matmul import MatmulConfig, decode_matmul, select  # noqa: E402
from trtbuild.timing import graph_seconds  # noqa: E402
from trtbuild.models.llama import LlamaConfig  # noqa: E402
from trtbuild.recipe import load_recipe  # noqa: E402

DEVICE = "cuda"  # a module constant so the probe's bookkeeping can be dry-run on the CPU (Triton's interpreter)


def weight_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, int]]:
    """Per-layer weight shapes [out, in] as the model holds them (QKV and gate/up fused)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"qkv": (q + 2 * kv, cfg.hidden_size), "o": (cfg.hidden_size, q),
            "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size), "down": (cfg.hidden_size, cfg.intermediate_size)}


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
    total = sum(w.numel() * w.element_size() for ws in weights.values() for w in ws)
    out: dict[str, Any] = {"recipe": recipe.name, "layers": cfg.num_layers, "weight_bytes": total, "shapes": {}, "step": {}}
    for m in batches:
        choice: dict[str, str] = {}
        for name, (n, k) in shapes.items():
            row = {"n": n, "k": k, "calls": len(weights[name])} | select(weights[name], m, reps=reps)
            nbytes = n * k * 2
            row["cublas_TBps"] = nbytes / row["cublas_us"] / 1e6
            best = fastest(row)
            row["triton_best"] = {"config": best, "us": row["candidates"][best],
                                  "TBps": nbytes / row["candidates"][best] / 1e6} if best else None
            choice[name] = row["choice"]
            out["shapes"].setdefault(str(m), {})[name] = row
            tb = row["triton_best"] or {}
            print(f"[probe] {recipe.name} b{m} {name:8s} [{n}x{k}] cublas {row['cublas_us']:8.2f} us "
                  f"{row['cublas_TBps']:.2f} TB/s | triton {tb.get('us', float('nan')):8.2f} us "
                  f"{tb.get('TBps', float('nan')):.2f} TB/s {tb.get('config', '-')} | "
                  f"{sum(1 for v in row['candidates'].values() if isinstance(v, str))} refused/failed", flush=True)

        def step(plan: dict[str, str], m: int = m) -> Callable[[], None]:
            xs = {name: torch.randn(m, shapes[name][1], device=dev, dtype=dtype, generator=gen) for name in shapes}
            ys = {name: torch.empty(m, shapes[name][0], device=dev, dtype=dtype) for name in shapes}

            def one(name: str, w: torch.Tensor) -> None:
                if plan[name] == "cublas":
                    F.linear(xs[name], w)
                else:
                    decode_matmul(xs[name], w, MatmulConfig.parse(plan[name]), out=ys[name])

            def calls() -> None:
                for layer in range(cfg.num_layers):
                    for name in ("qkv", "o", "gate_up", "down"):
                        one(name, weights[name][layer])
                one("head", weights["head"][0])
            return calls

        plans = {"cublas": {n: "cublas" for n in shapes}, "selected": choice}
        for plan, chosen in plans.items():
            t = graph_seconds(step(chosen), reps)
            out["step"].setdefault(str(m), {})[plan] = {"ms": t * 1e3, "TBps": total / t / 1e12, "choice": chosen}
            print(f"[probe] {recipe.name} b{m} whole step's matmuls, {plan:9s} {t * 1e3:7.3f} ms "
                  f"{total / t / 1e12:.2f} TB/s {chosen if plan == 'selected' else ''}", flush=True)
    weights.clear()  # free this recipe's weights before the next
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
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": device,
              "torch": torch.__version__, "command": " ".join(sys.argv), "recipes": []}
    a.out.mkdir(parents=True, exist_ok=True)
    for path in a.recipes:
        result["recipes"].append(probe_recipe(path, [int(b) for b in a.batches.split(",")], a.reps))
        (a.out / "matmul_probe.json").write_text(json.dumps(result, indent=1))
    print(f"[probe] done in {time.perf_counter() - t0:.0f} s; {a.out / 'matmul_probe.json'}")


if __name__ == "__main__":
    main()
