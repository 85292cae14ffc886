"""GPTQ's column loops on a GPU, each way they can run: eager torch, torch replayed from captured CUDA graphs, and
(fp8/int8) the Triton block kernel.

For Llama-3.2-1B's and Llama-3.1-8B's Linear shapes, runs `gptq.gptq_channel` (fp8, int8) and `gptq.gptq_int4` on
a random weight and a random input Hessian each way (`gptq.CHANNEL_BLOCK_KERNEL` and `gptq.BlockGraphs.CAPTURE`
set in turn, the GPU synchronized around each, a first call outside the timing for compiles and captures) and
reports the seconds, whether every way stored the same tensors as the eager loop (they should, bit for bit), and
the relative output error tr(dW H dW^T) / tr(W H W^T). The model's total is each shape's time times its layers:
what a build's quantize phase spends in the loops (its calibration forward passes apart). Writes gptq_probe.json
and gptq_probe.md under --out. Needs CUDA (and Triton for the kernel).

    python3 benchmarks/probes/gptq_probe.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# Linear shapes (out, in) a layer and the layers: Llama-3.2-1B, Llama-3.1-8B
MODELS = {"1b": ({"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}, 16),
          "8b": ({"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}, 32)}
# way -> (the block kernel, captured graphs); int4 has no kernel
WAYS = {"eager": (False, False), "graphs": (False, True), "kernel": (True, True)}


def timed(fn: Any) -> tuple[Any, float]:
    import torch

    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t


def main() -> None:
    import torch

    from trtbuild.models import gptq, quantize

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", nargs="+", default=["1b", "8b"], choices=sorted(MODELS))
    ap.add_argument("--formats", nargs="+", default=["fp8", "int4"], choices=["fp8", "int8", "int4"])
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    rows: list[dict[str, Any]] = []
    for model in args.models:
        shapes, layers = MODELS[model]
        for name, (n, k) in shapes.items():
            w = torch.randn(n, k, device="cuda", generator=g) * 0.02
            x = torch.randn(4096, k, device="cuda", generator=g) * (1 + torch.rand(k, device="cuda", generator=g) * 4)
            h = 2 * x.T @ x / x.shape[0]
            ref = ((w @ h) * w).sum()
            for fmt in args.formats:
                row: dict[str, Any] = {"model": model, "shape": name, "n": n, "k": k, "format": fmt, "layers": layers}

                def run(weight: Any, fmt: str = fmt) -> dict[str, Any]:
                    return gptq.gptq_int4(weight, h) if fmt == "int4" else gptq.gptq_channel(weight, h, fmt)

                stored_by_way = {}
                for way, (kernel, capture) in WAYS.items():
                    if way == "kernel" and fmt == "int4":
                        continue
                    gptq.CHANNEL_BLOCK_KERNEL, gptq.BlockGraphs.CAPTURE = kernel, capture
                    try:
                        if way != "eager":  # compiles and captures outside the timing (the same shapes)
                            run(w)
                        stored, seconds = timed(lambda: run(w))
                    finally:
                        gptq.CHANNEL_BLOCK_KERNEL, gptq.BlockGraphs.CAPTURE = True, True
                        gptq.BLOCK_GRAPHS.clear()
                    back = quantize.dequantize(fmt, stored["qweight"], stored["scale"],
                                               stored.get("zero"), torch.float32)
                    dw = back - w
                    row[way] = {"s": seconds, "error": float(((dw @ h) * dw).sum() / ref)}
                    stored_by_way[way] = stored
                eager = stored_by_way["eager"]
                row["same_as_eager"] = {way: all(torch.equal(s[t].float(), eager[t].float()) for t in eager)
                                        for way, s in stored_by_way.items() if way != "eager"}
                rows.append(row)
                print(f"{model} {name:8} {fmt}: " + ", ".join(f"{way} {row[way]['s']:.3f} s" for way in WAYS if way in row)
                      + f"; the same as eager: {row['same_as_eager']}; error {row['eager']['error']:.3e}", flush=True)
    lines = ["| model | shape | format | eager s | graphs s | kernel s | the same as eager | error |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r[way]['s']:.4f}" if way in r else "-" for way in WAYS]
        same = ", ".join(f"{way} {'yes' if ok else 'NO'}" for way, ok in r["same_as_eager"].items())
        lines.append(f"| {r['model']} | {r['shape']} {r['n']}x{r['k']} | {r['format']} | {' | '.join(cells)} | {same} | "
                     f"{r['eager']['error']:.3e} |")
    lines += ["", "| model | format | the loops over every layer, eager s | graphs s | kernel s |", "|---|---|---|---|---|"]
    for model in args.models:
        for fmt in args.formats:
            mine = [r for r in rows if r["model"] == model and r["format"] == fmt]
            totals = [f"{sum(r[way]['s'] * r['layers'] for r in mine):.1f}" if all(way in r for r in mine) else "-"
                      for way in WAYS]
            lines.append(f"| {model} | {fmt} | {' | '.join(totals)} |")
    text = (f"# GPTQ's column loops, {torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d')}\n\n"
            + "\n".join(lines) + "\n")
    print(text)
    (out / "gptq_probe.md").write_text(text)
    (out / "gptq_probe.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
