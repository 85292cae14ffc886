"""Decode matmuls: trtbuild's Triton kernel against cuBLAS, per weight shape and for a whole step.

A decode step's matmuls read every weight once for 1-8 rows of activations. This probe allocates a
recipe's weight matrices for every layer (distinct tensors, so no call finds its matrix in the 50 MB
L2 cache left by the previous one, as in a real step), and for each weight shape and batch size times,
inside one CUDA graph per candidate (no launch overhead, as in the engine):
  - cuBLAS through `F.linear` (what the compiled graphs call at tactics `default`),
  - every candidate launch configuration of `trtbuild.kernels.decode_matmul` (the build's own
    selection, `decode_matmul.select`),
  - with `--configs`, more configurations (names, or `wide`: WIDE at batch 1, WIDE_ROWS above), timed the
    same way and judged against ATen the same way, without making them build candidates (a build with a
    longer list times every call site of that batch again: ~90 s at 8B),
then the whole step's matmuls in layer order (QKV, output, gate/up, down per layer, then the LM head)
with cuBLAS only, with what the selection chose per shape and, with `--configs`, with the fastest of
all per shape. `--fusion epilogue` gives each call site the default engine's fusion (the residual adds and the gating in the kernel). Bandwidth is weight bytes
read / time (the copy rate of bench.py counts read + write).
A probe for choosing a default, not a benchmark of the engine (bench.py is that). Needs CUDA + Triton.

    python benchmarks/probes/matmul_probe.py recipes/llama-3.1-8b.yaml recipes/llama-3.2-1b.yaml --out $OUT
    python benchmarks/probes/matmul_probe.py recipes/llama-3.1-8b.yaml --batches 1 --configs wide \
        --fusion epilogue --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from trtbuild.backends.torch.decode_kernels import fastest  # noqa: E402
from trtbuild.kernels.decode_matmul import (GATED, MatmulConfig, _failure, decode_matmul,  # noqa: E402
                                           output_columns, reference, select)
from trtbuild.timing import graph_seconds  # noqa: E402
from trtbuild.models.llama import LlamaConfig  # noqa: E402
from trtbuild.recipe import load_recipe  # noqa: E402

# module constants so the probe's bookkeeping can be dry-run on the CPU (Triton's interpreter, fp32)
DEVICE = "cuda"
DTYPE = torch.bfloat16


def weight_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, int]]:
    """Per-layer weight shapes [out, in] as the model holds them (QKV and gate/up fused)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"qkv": (q + 2 * kv, cfg.hidden_size), "o": (cfg.hidden_size, q),
            "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size), "down": (cfg.hidden_size, cfg.intermediate_size)}


# The call sites as the default engine runs them (options.decode_fusion epilogue): the residual add after the
# output and down projections and the gating after gate/up in the kernel, the norms outside it.
EPILOGUE_FUSION = {"qkv": "none", "o": "residual", "gate_up": "gate", "down": "residual", "head": "none"}
# `--configs wide`: one-row configurations beyond the build's ONE_ROW, around its usual batch-1 winners
# (n4k1024 and n8k1024 at 8B): longer k steps, narrower blocks, 8 warps and more stages. A PDL chain
# of GEMVs ranked n4k1024 and n8k1024 differently serialized and with PDL (RESULTS.md, 2026-12-04 H200);
# this times such neighbours per weight shape, both ways, before any of them becomes a build candidate
# (`trtbuild/kernels/matmul_configs.py`; a longer list times that batch's call sites again).
WIDE = [MatmulConfig(n, k, w, s) for n in (2, 4, 8) for k in (1024, 2048, 4096) for w in (4, 8) for s in (1, 3)]
# and for 2-16 rows (the tensor-core path, blocks of at least 16 columns), beyond the build's ROWS: longer k
# steps, 8 warps, 2-5 stages. The 1B shape's batch 8 is the decode row furthest from its target (1.68x).
WIDE_ROWS = [MatmulConfig(n, k, w, s) for n in (16, 32) for k in (512, 1024) for w in (4, 8) for s in (2, 3, 5)]


def parse_configs(spec: str) -> dict[str, list[MatmulConfig]]:
    """`--configs`: "wide" ({"one": WIDE for batch 1, "rows": WIDE_ROWS for more}), or configuration names
    as the build records them (n4k2048w4s3), timed at every batch."""
    if spec in ("", "wide"):
        return {"one": list(WIDE), "rows": list(WIDE_ROWS)} if spec else {}
    configs = []
    for name in spec.split(","):
        try:
            config = MatmulConfig.parse(name.strip())
        except ValueError:
            raise SystemExit(f"--configs: {name!r} is not a configuration name like n4k2048w4s3") from None
        sizes = (config.block_n, config.block_k)
        if config.split != 1 or any(s < 1 or s & (s - 1) for s in sizes) or config.warps not in (1, 2, 4, 8, 16):
            raise SystemExit(f"--configs: {name!r}: blocks must be powers of two, warps 1-16, no split-K")
        configs.append(config)
    return {"one": configs, "rows": configs}


def time_config(weights: list[torch.Tensor], rows: int, fusion: str, config: MatmulConfig, reps: int) -> float | str:
    """µs a call of one configuration over `weights` in a CUDA graph, as `select` times its own candidates
    (the same fusion, distinct matrices, checked against ATen first); an error string where it is refused
    or fails. For the epilogue fusions only (no norm)."""
    w0 = weights[0]
    gate = fusion in GATED
    x = torch.randn(rows, w0.shape[1], device=w0.device, dtype=w0.dtype)
    width = output_columns(w0, gate)
    residual = torch.randn(rows, width, device=w0.device, dtype=w0.dtype) if fusion == "residual" else None
    ys = [torch.empty(rows, width, device=w0.device, dtype=w0.dtype) for _ in weights]
    ref = reference(x, w0, fusion, None, 0.0, residual).float()
    try:
        got = decode_matmul(x, w0, config, out=ys[0], gate=gate, residual=residual).float()
        err = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
        if not err <= 2e-2:
            return f"refused: max relative error {err:.3g} against ATen"

        def calls() -> None:
            for w, y in zip(weights, ys, strict=True):
                decode_matmul(x, w, config, out=y, gate=gate, residual=residual)
        return graph_seconds(calls, reps) / len(weights) * 1e6
    except Exception as e:  # a configuration that does not compile is a measurement too, recorded as select does
        return _failure(e)


def shape_row(weights: list[torch.Tensor], m: int, fusion: str, extra: list[MatmulConfig], reps: int) -> dict[str, Any]:
    """One weight shape at batch m: the build's selection (`select`), then each extra configuration not among
    its candidates, and which way is fastest of all ("best": cuBLAS, with Inductor's ops for a fused site,
    or a configuration)."""
    n, k = weights[0].shape
    row = {"n": n, "k": k, "calls": len(weights)} | select(weights, m, fusion, reps=reps)
    own = set(row["candidates"])
    row["extra"] = {c.name: time_config(weights, m, fusion, c, reps) for c in extra if c.name not in own}
    unfused = row.get("unfused_us")
    baseline: float = unfused if isinstance(unfused, float) else row["cublas_us"]
    timed = {name: us for name, us in (row["candidates"] | row["extra"]).items() if isinstance(us, float)}
    best = min(timed, key=timed.__getitem__) if timed else None
    row["best"] = best if best is not None and timed[best] < baseline else "cublas"
    row["baseline_us"] = baseline
    return row


def probe_recipe(path: str, batches: list[int], reps: int, extra: dict[str, list[MatmulConfig]] | None = None,
                 fusion: str = "none",
                 save: Callable[[dict[str, Any]], None] = lambda partial: None) -> dict[str, Any]:
    """Every weight shape of the recipe at each batch, with `fusion` (none, or epilogue: the default engine's
    call sites). `extra` configurations (`parse_configs`: "one" at
    batch 1, "rows" above) are timed beside the build's own candidates, and the step's matmuls are timed with each plan. `save`
    gets the result so far after each batch (a probe cut off by its time limit keeps what it measured)."""
    recipe = load_recipe(path)
    assert recipe.model.config is not None, "the probe takes recipes with an inline (synthetic) config"
    cfg = LlamaConfig.from_hf(recipe.model.config)
    dev, dtype = torch.device(DEVICE), DTYPE
    gen = torch.Generator(device=dev).manual_seed(0)

    def weight(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, device=dev, dtype=dtype, generator=gen) * 0.02).contiguous()

    shapes = weight_shapes(cfg)
    weights = {name: [weight(*shape) for _ in range(cfg.num_layers)] for name, shape in shapes.items()}
    weights["head"] = [weight(cfg.vocab_size, cfg.hidden_size)]
    shapes["head"] = (cfg.vocab_size, cfg.hidden_size)
    fusions = {name: EPILOGUE_FUSION[name] if fusion == "epilogue" else "none" for name in shapes}
    total = sum(w.numel() * w.element_size() for ws in weights.values() for w in ws)
    out: dict[str, Any] = {"recipe": recipe.name, "layers": cfg.num_layers, "weight_bytes": total, "fusion": fusions,
                           "shapes": {}, "step": {}}
    for m in batches:
        more = (extra or {}).get("one" if m == 1 else "rows", [])
        rows = {name: shape_row(weights[name], m, fusions[name], more, reps) for name in shapes}
        out["shapes"][str(m)] = rows
        for name, row in rows.items():
            _print_shape(recipe.name, m, name, row)
        plans = {"cublas": {n: "cublas" for n in shapes}, "selected": {n: r["choice"] for n, r in rows.items()}}
        if more:
            plans["best"] = {n: r["best"] for n, r in rows.items()}
        for plan, chosen in plans.items():
            t = graph_seconds(_step(cfg, weights, fusions, chosen, m, gen), reps)
            out["step"].setdefault(str(m), {})[plan] = {"ms": t * 1e3, "TBps": total / t / 1e12, "choice": chosen}
            print(f"[probe] {recipe.name} b{m} whole step's matmuls, {plan:9s} {t * 1e3:7.3f} ms "
                  f"{total / t / 1e12:.2f} TB/s {chosen if plan != 'cublas' else ''}", flush=True)
        save(out)
    weights.clear()  # free this recipe's weights before the next
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return out


def _print_shape(recipe: str, m: int, name: str, row: dict[str, Any]) -> None:
    nbytes = row["n"] * row["k"] * DTYPE.itemsize
    timed = {c: us for c, us in (row["candidates"] | row["extra"]).items() if isinstance(us, float)}
    own = fastest(row)
    parts = [f"[probe] {recipe} b{m} {name:8s} [{row['n']}x{row['k']}] cublas {row['cublas_us']:8.2f} us "
             f"{nbytes / row['cublas_us'] / 1e6:.2f} TB/s"]
    unfused = row.get("unfused_us")
    if unfused is not None:  # a fused call site: cuBLAS with Inductor's ops around it
        parts.append(f"with its ops {unfused:.2f} us" if isinstance(unfused, float) else f"with its ops {unfused}")
    if own is not None:
        parts.append(f"| build's best {row['candidates'][own]:8.2f} us {nbytes / row['candidates'][own] / 1e6:.2f} TB/s {own}")
    extra = {c: us for c, us in timed.items() if c in row["extra"]}
    if extra:
        e = min(extra, key=extra.__getitem__)
        parts.append(f"| extra's best {extra[e]:8.2f} us {e}")
    failed = sum(1 for v in (row["candidates"] | row["extra"]).values() if isinstance(v, str))
    print(" ".join(parts) + f" | {failed} refused/failed", flush=True)


def _step(cfg: LlamaConfig, weights: dict[str, list[torch.Tensor]], fusions: dict[str, str], plan: dict[str, str],
          m: int, gen: torch.Generator) -> Callable[[], None]:
    """The step's matmuls in layer order with `plan` per shape: a configuration, or cuBLAS (with the fusion's
    ops in eager ATen: one or two launches more than Inductor's one kernel would make of them)."""
    dev, dtype = weights["head"][0].device, weights["head"][0].dtype
    xs = {name: torch.randn(m, ws[0].shape[1], device=dev, dtype=dtype, generator=gen) for name, ws in weights.items()}
    width = {name: output_columns(ws[0], fusions[name] in GATED) for name, ws in weights.items()}
    ys = {name: torch.empty(m, width[name], device=dev, dtype=dtype) for name in weights}
    rs = {name: torch.randn(m, width[name], device=dev, dtype=dtype, generator=gen) if fusions[name] == "residual" else None
          for name in weights}

    def one(name: str, w: torch.Tensor) -> None:
        if plan[name] == "cublas":
            reference(xs[name], w, fusions[name], None, 0.0, rs[name])
        else:
            decode_matmul(xs[name], w, MatmulConfig.parse(plan[name]), out=ys[name], gate=fusions[name] in GATED,
                          residual=rs[name])

    def calls() -> None:
        for layer in range(cfg.num_layers):
            for name in ("qkv", "o", "gate_up", "down"):
                one(name, weights[name][layer])
        one("head", weights["head"][0])
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipes", nargs="+")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--configs", default="", help="configurations to time beside the build's candidates: names "
                    "(n4k2048w4s3,...), at every batch, or 'wide' (WIDE at batch 1, WIDE_ROWS above)")
    ap.add_argument("--fusion", choices=("none", "epilogue"), default="none",
                    help="epilogue: each call site with the default engine's fusion (residual, gating)")
    ap.add_argument("--out", type=Path, default=Path("."))
    a = ap.parse_args()
    extra = parse_configs(a.configs)
    t0 = time.perf_counter()
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": device,
              "torch": torch.__version__, "command": " ".join(sys.argv), "recipes": []}
    a.out.mkdir(parents=True, exist_ok=True)
    def save(partial: dict[str, Any]) -> None:
        (a.out / "matmul_probe.json").write_text(json.dumps(result | {"recipes": [*result["recipes"], partial]}, indent=1))

    for path in a.recipes:
        result["recipes"].append(probe_recipe(path, [int(b) for b in a.batches.split(",")], a.reps, extra, a.fusion,
                                              save))
        (a.out / "matmul_probe.json").write_text(json.dumps(result, indent=1))
    print(f"[probe] done in {time.perf_counter() - t0:.0f} s; {a.out / 'matmul_probe.json'}")


if __name__ == "__main__":
    main()
