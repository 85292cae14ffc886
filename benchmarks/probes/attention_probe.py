"""Decode attention: trtbuild's Triton kernel against the masked attention Inductor compiles from the model.

For each recipe, batch size and decode position, this allocates every layer's K and V cache at the
engine's shape ([max batch, KV heads, max_seq_len + 1, head_dim], distinct per layer, random bf16) and
times, inside one CUDA graph per variant (no launch overhead, as in the engine), one step's attention
over all layers:
  - aten: `llama._cached_attention` under torch.compile (Inductor, default options: what an engine
    built with options.decode_attention aten runs), over the runtime's window for that position,
  - kernel: `decode_attention.decode_attention` (two Triton launches per layer), reading slots 0..pos,
  - from the QKV projection's output, as a decode step starts: `rope`, the kernel with the rotation and the
    cache writes inside it (`decode_attention_rope`, options.decode_attention kernel), against `split`,
    the rotation and cache writes compiled by Inductor from the model's code, then the kernel
    (options.decode_attention kernel-unfused).
It also reports the largest difference between the aten and kernel outputs, and between rope and split
(bf16).

A probe for choosing a default, not a benchmark of the engine (bench.py is that). Needs CUDA + Triton.

    python benchmarks/probes/attention_probe.py recipes/llama-3.1-8b.yaml recipes/llama-3.2-1b.yaml --out $OUT
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import probe_report  # noqa: E402  (a sibling script's module: this folder is on sys.path)
import torch  # noqa: E402

from trtbuild.backends.torch.decode_graphs import decode_windows  # noqa: E402
from trtbuild.kernels.decode_attention import (  # noqa: E402
    decode_attention, decode_attention_rope, num_splits)
from trtbuild.timing import graph_seconds  # noqa: E402
from trtbuild.models.llama import LlamaConfig, _cached_attention, rope_and_store, rope_table  # noqa: E402
from trtbuild.recipe import load_recipe  # noqa: E402


def probe_recipe(path: str, batches: list[int], positions: list[int], reps: int) -> dict[str, Any]:
    recipe = load_recipe(path)
    assert recipe.model.config is not None, "the probe takes recipes with an inline (synthetic) config"
    cfg = LlamaConfig.from_hf(recipe.model.config)
    shapes = recipe.shapes
    dev, dtype = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    slots = shapes.max_seq_len + 1
    caches = [[torch.randn(shapes.max_batch_size, cfg.num_kv_heads, slots, cfg.head_dim, device=dev, dtype=dtype,
                           generator=gen) for _ in range(2)] for _ in range(cfg.num_layers)]
    windows = decode_windows(shapes.max_seq_len)
    aten = torch.compile(_cached_attention, dynamic=False)
    # the model's own rotation and cache writes (options.decode_attention kernel-unfused), query returned
    rope_split = torch.compile(lambda qkv, table, pos, k, v: rope_and_store(
        qkv, table, pos.reshape(1, 1), torch.arange(qkv.shape[0], device=qkv.device), k, v, cfg)[0], dynamic=False)
    rope = rope_table(cfg, shapes.max_seq_len).to(dev)
    width = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    out: dict[str, Any] = {"recipe": recipe.name, "layers": cfg.num_layers, "heads": cfg.num_heads,
                           "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rows": []}
    for b in batches:
        qs = [torch.randn(b, 1, cfg.num_heads, cfg.head_dim, device=dev, dtype=dtype, generator=gen)
              for _ in range(cfg.num_layers)]
        qkvs = [torch.randn(b, 1, width, device=dev, dtype=dtype, generator=gen) for _ in range(cfg.num_layers)]
        for p in positions:
            if p >= shapes.max_seq_len:
                continue
            window = next(w for w in windows if w > p)
            pos, span = torch.tensor([p], device=dev), torch.arange(window, device=dev)
            ys_aten: list[torch.Tensor] = []
            ys_kernel: list[torch.Tensor] = []

            def run_aten(ys: list[torch.Tensor] = ys_aten, qs: list[torch.Tensor] = qs, b: int = b,
                         pos: torch.Tensor = pos, span: torch.Tensor = span) -> None:
                ys.clear()
                for q, (k, v) in zip(qs, caches, strict=True):
                    ys.append(aten(q.transpose(1, 2), k[:b], v[:b], pos, span))

            def run_kernel(ys: list[torch.Tensor] = ys_kernel, qs: list[torch.Tensor] = qs,
                           pos: torch.Tensor = pos) -> None:
                ys.clear()
                for q, (k, v) in zip(qs, caches, strict=True):
                    ys.append(decode_attention(q, k, v, pos))

            ys_rope: list[torch.Tensor] = []
            ys_split: list[torch.Tensor] = []

            def run_rope(ys: list[torch.Tensor] = ys_rope, qkvs: list[torch.Tensor] = qkvs,
                         pos: torch.Tensor = pos) -> None:
                ys.clear()
                for qkv, (k, v) in zip(qkvs, caches, strict=True):
                    ys.append(decode_attention_rope(qkv, rope, k, v, pos, cfg.num_heads))

            def run_split(ys: list[torch.Tensor] = ys_split, qkvs: list[torch.Tensor] = qkvs,
                          pos: torch.Tensor = pos) -> None:
                ys.clear()
                table = rope[pos]  # once a step, as the model does
                for qkv, (k, v) in zip(qkvs, caches, strict=True):
                    ys.append(decode_attention(rope_split(qkv, table, pos, k, v), k, v, pos))

            aten_s = graph_seconds(run_aten, reps)
            kernel_s = graph_seconds(run_kernel, reps)
            rope_s = graph_seconds(run_rope, reps)
            split_s = graph_seconds(run_split, reps)
            # both write the same new K and V at slot p, so the two last runs read the same caches
            rope_err = max((yr.float() - yp.float()).abs().max().item()
                           for yr, yp in zip(ys_rope, ys_split, strict=True))
            err = max((ya.transpose(1, 2).float() - yk.float()).abs().max().item()
                      for ya, yk in zip(ys_aten, ys_kernel, strict=True))
            kv_bytes = 2 * b * cfg.num_kv_heads * (p + 1) * cfg.head_dim * 2 * cfg.num_layers
            row: dict[str, Any] = {"batch": b, "position": p, "window": window, "splits": num_splits(b, cfg.num_kv_heads),
                   "aten_us_per_layer": aten_s / cfg.num_layers * 1e6,
                   "kernel_us_per_layer": kernel_s / cfg.num_layers * 1e6,
                   "step_saving_us": (aten_s - kernel_s) * 1e6, "kv_bytes_per_step": kv_bytes,
                   "kernel_TBps": kv_bytes / kernel_s / 1e12, "max_abs_diff": err,
                   "rope_us_per_layer": rope_s / cfg.num_layers * 1e6, "split_us_per_layer": split_s / cfg.num_layers * 1e6,
                   "rope_max_abs_diff": rope_err}
            out["rows"].append(row)
            print(f"{recipe.name} b{b} pos {p:5d} (window {window:5d}): aten {row['aten_us_per_layer']:7.2f} us/layer, "
                  f"kernel {row['kernel_us_per_layer']:7.2f} us/layer ({row['kernel_TBps']:.2f} TB/s), "
                  f"step {row['step_saving_us']:+8.1f} us saved, max |diff| {err:.3g}; from QKV: rope in the kernel "
                  f"{row['rope_us_per_layer']:7.2f} us/layer, split {row['split_us_per_layer']:7.2f} us/layer, "
                  f"max |diff| {rope_err:.3g}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipes", nargs="+")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--positions", default="200,1000,4000")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    batches, positions = [int(b) for b in args.batches.split(",")], [int(p) for p in args.positions.split(",")]
    probe_report.run(args.recipes, lambda path: probe_recipe(path, batches, positions, args.reps), args.out,
                     "attention-probe.json")


if __name__ == "__main__":
    main()
