"""GPTQ per output channel (fp8, int8): the column loop in torch against one Triton launch a block.

For Llama-3.2-1B's and Llama-3.1-8B's Linear shapes, times `gptq.gptq_channel` on a random weight and a
random input Hessian both ways (`gptq.CHANNEL_BLOCK_KERNEL` off and on, the GPU synchronized around each),
and reports the seconds, how many codes agree, and each way's relative output error tr(dW H dW^T) / tr(W H W^T).
The model's total is each shape's time times its layers: what a build's quantize phase spends in the loop (its
calibration forward passes apart). Writes gptq_probe.json and gptq_probe.md under --out. Needs CUDA and Triton.

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
    ap.add_argument("--formats", nargs="+", default=["fp8"], choices=["fp8", "int8"])
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
                result: dict[str, Any] = {"model": model, "shape": name, "n": n, "k": k, "format": fmt, "layers": layers}
                for way, kernel in (("torch", False), ("kernel", True)):
                    gptq.CHANNEL_BLOCK_KERNEL = kernel
                    if kernel:  # compiled outside the timing
                        gptq.gptq_channel(w[:64], h, fmt)
                    stored, seconds = timed(lambda: gptq.gptq_channel(w, h, fmt))
                    back = quantize.dequantize(fmt, stored["qweight"], stored["scale"], None, torch.float32)
                    dw = back - w
                    result[way] = {"s": seconds, "error": float(((dw @ h) * dw).sum() / ref)}
                    result[f"{way}_codes"] = stored["qweight"].float()
                same = (result.pop("torch_codes") == result.pop("kernel_codes")).float().mean().item()
                result["codes_equal"] = same
                result["speedup"] = result["torch"]["s"] / result["kernel"]["s"]
                rows.append(result)
                print(f"{model} {name:8} {fmt} torch {result['torch']['s']:.3f} s, kernel {result['kernel']['s']:.4f} s "
                      f"({result['speedup']:.0f}x); codes equal {same:.5f}; error {result['torch']['error']:.3e} / "
                      f"{result['kernel']['error']:.3e}", flush=True)
    lines = ["| model | shape | format | torch s | kernel s | × | codes equal | error torch / kernel |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['shape']} {r['n']}x{r['k']} | {r['format']} | {r['torch']['s']:.3f} | "
                     f"{r['kernel']['s']:.4f} | {r['speedup']:.0f} | {r['codes_equal']:.5f} | "
                     f"{r['torch']['error']:.3e} / {r['kernel']['error']:.3e} |")
    lines += ["", "| model | format | the loop over every layer, torch s | kernel s |", "|---|---|---|---|"]
    for model in args.models:
        for fmt in args.formats:
            mine = [r for r in rows if r["model"] == model and r["format"] == fmt]
            lines.append(f"| {model} | {fmt} | {sum(r['torch']['s'] * r['layers'] for r in mine):.1f} | "
                         f"{sum(r['kernel']['s'] * r['layers'] for r in mine):.2f} |")
    text = (f"# GPTQ per channel, {torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d')}\n\n"
            + "\n".join(lines) + "\n")
    print(text)
    (out / "gptq_probe.md").write_text(text)
    (out / "gptq_probe.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
